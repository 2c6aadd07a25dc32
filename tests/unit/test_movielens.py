"""The recommendation task's data and metrics, in one process: the three MovieLens formats, bad
input (one line each), the split, the cache, the generator, deterministic negatives, and the
metric arithmetic checked by hand."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hvdtrain.config import ConfigError
from hvdtrain.data import DataError
from hvdtrain.data.ratings.batches import ImplicitPairs, PairSet, RankedCandidates
from hvdtrain.data.ratings.movielens import (
    find_ratings_file,
    generate_ratings,
    load_split,
    parse_ratings,
    split_mask,
    write_ratings_csv,
)
from hvdtrain.job_config import load_config
from hvdtrain.tasks.recommendation.task import (
    IdMap,
    Recommendation,
    ranking_sums,
    summarize_explicit,
    summarize_implicit,
)

# (user, item, rating, timestamp): user 7 rated three movies, user 3 two, user 12 one.
ROWS = [(7, 50, 4.0, 300), (3, 50, 3.5, 100), (7, 10, 5.0, 900), (12, 10, 1.0, 50), (3, 99, 2.0, 400),
        (7, 99, 0.5, 200)]


def write(folder: Path, fmt: str, rows=ROWS, header: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "ratings.csv":
        lines = (["userId,movieId,rating,timestamp"] if header else []) + [f"{u},{i},{r:g},{t}" for u, i, r, t in rows]
    else:
        sep = "\t" if fmt == "u.data" else "::"
        lines = [sep.join(str(v) for v in (u, i, int(r) if r == int(r) else r, t)) for u, i, r, t in rows]
    path = folder / fmt
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["ratings.csv", "u.data", "ratings.dat"])
def test_each_format_is_detected_and_parsed_with_dense_ids(fmt, tmp_path):
    path = write(tmp_path / "ml", fmt)
    assert find_ratings_file(tmp_path / "ml") == (path, fmt)
    ratings = parse_ratings(path, fmt)
    assert ratings.user_ids.tolist() == [3, 7, 12] and ratings.item_ids.tolist() == [10, 50, 99]
    assert ratings.users.tolist() == [1, 0, 1, 2, 0, 1]
    assert ratings.items.tolist() == [1, 1, 0, 0, 2, 2]
    assert ratings.ratings.tolist() == [4.0, 3.5, 5.0, 1.0, 2.0, 0.5]
    assert ratings.timestamps.tolist() == [300, 100, 900, 50, 400, 200]


@pytest.mark.parametrize("fmt, content, message", [
    ("ratings.csv", "", "ratings.csv is empty: no ratings to train on"),
    ("u.data", "", "u.data is empty: no ratings to train on"),
    ("ratings.csv", "user,item,stars\n1,2,3\n", "ratings.csv, line 1: not a MovieLens ratings.csv (expected the "
                                                 "header 'userId,movieId,rating,timestamp'"),
    ("u.data", "1,2,3,4\n", "u.data, line 1: not in the u.data format"),
    ("ratings.dat", "1\t2\t3\t4\n", "ratings.dat, line 1: not in the ratings.dat format"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,2,3,4\n1,3,7.5,5\n",
     "ratings.csv, line 3: rating '7.5' is outside the scale 0.5-5"),
    ("u.data", "1\t2\t0\t4\n", "u.data, line 1: rating '0' is outside the scale 0.5-5"),
    ("ratings.dat", "1::2::3::4\nalice::2::3::4\n", "ratings.dat, line 2: user id 'alice' is not an integer"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,tt0111161,3,4\n",
     "ratings.csv, line 2: item id 'tt0111161' is not an integer"),
    ("u.data", "1\t2\t3\n", "u.data, line 1: expected 4 fields separated by '\\t', got 3"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,2,three,4\n", "rating 'three' is not a number"),
])
def test_bad_input_stops_with_one_line_naming_file_and_problem(fmt, content, message, tmp_path):
    (tmp_path / fmt).write_text(content)
    with pytest.raises(DataError) as caught:
        load_split(tmp_path, "leave_last_out", 0.1, 0, cache=False)
    text = str(caught.value)
    assert message in text and str(tmp_path / fmt) in text and "\n" not in text


def test_a_folder_with_no_known_file_names_the_formats(tmp_path):
    (tmp_path / "ratings.txt").write_text("1 2 3 4\n")
    with pytest.raises(DataError, match="holds no MovieLens ratings file in any known format .*ratings.csv.*u.data"
                                        ".*ratings.dat"):
        find_ratings_file(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        find_ratings_file(tmp_path / "missing")


def test_skip_counts_bad_lines_and_reports_the_first(tmp_path):
    rows = "userId,movieId,rating,timestamp\n1,2,3,4\n1,x,3,4\n2,2,9,4\n2,3,4.5,8\n"
    (tmp_path / "ratings.csv").write_text(rows)
    warnings: list[str] = []
    ratings = parse_ratings(tmp_path / "ratings.csv", "ratings.csv", on_bad_line="skip", warn=warnings.append)
    assert len(ratings) == 2 and ratings.skipped == 2
    assert "line 3: item id 'x'" in warnings[0] and "line 4: rating '9'" in warnings[1]
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,x,3,4\n")
    with pytest.raises(DataError, match="has no valid rating \\(1 bad lines skipped\\)"):
        parse_ratings(tmp_path / "ratings.csv", "ratings.csv", on_bad_line="skip")


def test_leave_last_out_holds_out_each_users_latest_rating(tmp_path):
    ratings = parse_ratings(write(tmp_path, "ratings.csv"), "ratings.csv")
    val = split_mask(ratings, "leave_last_out", 0.1, 0)
    # user 7's latest is (10, t=900); user 3's is (99, t=400); user 12 has one rating: kept for training.
    assert np.flatnonzero(val).tolist() == [2, 4]
    # Equal timestamps: the later line wins.
    ratings.timestamps[:] = 5
    assert np.flatnonzero(split_mask(ratings, "leave_last_out", 0.1, 0)).tolist() == [4, 5]


def test_random_split_is_a_seeded_fraction():
    users, items, values, stamps = generate_ratings(num_users=30, num_items=200, num_ratings=1000, seed=1)
    from hvdtrain.data.ratings.movielens import remap

    ratings = remap(users, items, values, stamps)
    a, b, c = (split_mask(ratings, "random", 0.2, seed) for seed in (5, 5, 6))
    assert a.sum() == 200 and np.array_equal(a, b) and not np.array_equal(a, c)


def test_cache_is_used_and_rebuilt_when_the_source_changes(tmp_path):
    path = write(tmp_path / "ml", "u.data")
    cache = tmp_path / "cache"
    first = load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=cache)
    assert not first.from_cache and first.cache_path.parent == cache / "movielens"
    second = load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=cache)
    assert second.from_cache and np.array_equal(second.val, first.val)
    assert np.array_equal(second.ratings.item_ids, first.ratings.item_ids)
    # Another split is another cache entry.
    assert not load_split(tmp_path / "ml", "random", 0.5, 0, fallback_cache=cache).from_cache
    # The source changes (one more rating): parsed again, and the new rating is there.
    path.write_text(path.read_text() + "99\t10\t3\t1000\n")
    os.utime(path, ns=(1, 1))
    third = load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=cache)
    assert not third.from_cache and len(third.ratings) == len(ROWS) + 1
    assert load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=cache).from_cache


def test_cache_is_in_the_user_cache_and_never_next_to_the_source(tmp_path):
    write(tmp_path / "ml", "ratings.dat")
    split = load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=tmp_path / "cache")
    assert not split.from_cache and split.cache_path.parent == tmp_path / "cache" / "movielens"
    assert load_split(tmp_path / "ml", "leave_last_out", 0.1, 0, fallback_cache=tmp_path / "cache").from_cache
    assert [p.name for p in (tmp_path / "ml").iterdir()] == ["ratings.dat"]  # nothing written beside the source
    assert [p.name for p in split.cache_path.parent.iterdir()] == [split.cache_path.name]  # no scratch file left


def test_generator_looks_like_ml_latest_small(tmp_path):
    users, items, values, stamps = generate_ratings()
    assert len(users) == 100_000 and len(np.unique(users)) == 610 and 8000 < len(np.unique(items)) <= 9000
    assert set(np.unique(values * 2).tolist()) <= set(range(1, 11))  # half stars 0.5-5
    assert 3.2 < values.mean() < 3.8 and 0.9 < values.std() < 1.2
    per_user = np.bincount(users)[1:]
    assert per_user.min() >= 20 and np.median(per_user) < per_user.mean()  # long-tailed activity
    popularity = np.sort(np.bincount(items))[::-1]
    assert popularity[:90].sum() > 0.10 * len(items)  # the top 1% of movies: over 10% of ratings (uniform: 1%)
    again = generate_ratings(num_users=20, num_items=100, num_ratings=500, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(again, generate_ratings(num_users=20, num_items=100,
                                                                            num_ratings=500, seed=3)))
    write_ratings_csv(tmp_path / "ratings.csv", *again)
    assert len(parse_ratings(tmp_path / "ratings.csv", "ratings.csv")) == 500


def test_negatives_depend_only_on_seed_epoch_and_index():
    users = np.array([0, 0, 1, 1, 2], dtype=np.int64)
    items = np.array([0, 1, 1, 2, 3], dtype=np.int64)
    positives = PairSet(users, items, num_items=6)
    data = ImplicitPairs(users, items, negatives=3, positives=positives, seed=7)
    everything = np.arange(len(data))
    (_, all_items), labels = data.batch(everything, epoch=2)
    assert labels.tolist() == [1.0, 0.0, 0.0, 0.0] * 5
    negative = labels == 0
    all_users = torch.from_numpy(np.repeat(users, 4))
    assert not positives.contains(all_users[negative].numpy(), all_items[negative].numpy()).any()
    # The same sample in another batch, in another order: the same negative.
    picked = np.array([13, 2, 7])
    (_, some_items), _ = data.batch(picked, epoch=2)
    assert some_items.tolist() == all_items[picked].tolist()
    (_, other_epoch), _ = data.batch(everything, epoch=3)
    assert not torch.equal(other_epoch, all_items)


def test_ranked_candidates_are_fixed_unrated_items_with_popularity():
    users = np.array([0, 1], dtype=np.int64)
    items = np.array([4, 2], dtype=np.int64)
    rated = PairSet(np.array([0, 0, 1]), np.array([4, 5, 2]), num_items=50)
    popularity = np.arange(50) * 10
    data = RankedCandidates(users, items, negatives=20, positives=rated, seed=1, popularity=popularity)
    (batch_users, candidates), scores = data.batch(np.array([0, 1]), epoch=0)
    assert candidates.shape == (2, 21) and candidates[:, 0].tolist() == [4, 2]
    assert 5 not in candidates[0, 1:].tolist() and 2 not in candidates[1, 1:].tolist()
    assert torch.equal(scores, torch.from_numpy(popularity)[candidates].double())
    (_, alone), _ = data.batch(np.array([1]), epoch=9)  # any epoch, any batch: the same candidates
    assert torch.equal(alone[0], candidates[1])


def test_ranking_metrics_by_hand():
    scores = torch.tensor([
        [5.0, 1, 2, 3],      # rank 0: hit, ndcg 1
        [1.0, 2, 3, 0],      # rank 2: hit, ndcg 1/log2(4) = 0.5
        [1.0, 1, 1, 1],      # ties count for the held-out item: rank 0
    ], dtype=torch.float64)
    hits, ndcg = ranking_sums(scores, k=3)
    assert hits.item() == 3 and ndcg.item() == pytest.approx(2.5)
    hits, ndcg = ranking_sums(scores, k=2)
    assert hits.item() == 2 and ndcg.item() == pytest.approx(2.0)
    metrics = summarize_implicit(torch.tensor([6.0, 2, 1.5, 1, 0.5, 4, 4], dtype=torch.float64))
    assert metrics == {"loss": 1.5, "samples": 4, "hr10": 0.5, "ndcg10": 0.375, "baseline_hr10": 0.25,
                       "baseline_ndcg10": 0.125}


def test_explicit_sums_and_metrics_by_hand():
    cfg = load_config("movielens", [])
    task = Recommendation(cfg)
    task.global_mean = 3.0
    outputs = torch.tensor([3.5, 2.0, 5.0])
    targets = torch.tensor([4.0, 2.0, 3.0])
    loss = task.loss(outputs, targets, training=False)
    sums = task.metric_sums(loss, outputs, targets)
    # errors -0.5, 0, 2 -> squared 4.25, absolute 2.5; the mean 3 misses by 1, 1, 0 -> 2 and 2.
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([4.25, 4.25, 2.5, 2.0, 2.0, 3.0])
    metrics = summarize_explicit(sums)
    assert metrics["rmse"] == pytest.approx(math.sqrt(4.25 / 3)) and metrics["mae"] == pytest.approx(2.5 / 3)
    assert metrics["baseline_rmse"] == pytest.approx(math.sqrt(2 / 3)) and metrics["samples"] == 3


def test_id_map_refuses_a_checkpoint_of_other_ratings():
    mine = IdMap(np.array([1, 2, 3]), np.array([10, 20]), "/data/a/ratings.csv")
    mine.load_state_dict(IdMap(np.array([1, 2, 3]), np.array([10, 20]), "/elsewhere").state_dict())
    with pytest.raises(DataError, match="trained on other ratings \\(/data/b/u.data: 4 users\\) than data.dir "
                                        "gives \\(/data/a/ratings.csv: 3 users\\)"):
        mine.load_state_dict(IdMap(np.array([1, 2, 3, 4]), np.array([10, 20]), "/data/b/u.data").state_dict())


def test_recommendation_config_checks():
    assert load_config("movielens", []).model.arch == "mf"
    assert load_config("movielens_ncf", []).recommendation.objective == "implicit"
    with pytest.raises(ConfigError, match="'model.arch': task=recommendation takes mf or ncf, got 'resnet18'"):
        load_config("movielens", ["model.arch=resnet18"])
    with pytest.raises(ConfigError, match="needs optim.name=sgd or adagrad"):
        load_config("movielens", ["recommendation.sparse_embeddings=true"])
    with pytest.raises(ConfigError, match="needs optim.weight_decay=0"):
        load_config("movielens", ["recommendation.sparse_embeddings=true", "optim.name=sgd", "optim.weight_decay=0.1"])
    with pytest.raises(ConfigError, match="'recommendation.mlp_layers'"):
        load_config("movielens_ncf", ["recommendation.mlp_layers=64,x"])
    with pytest.raises(ConfigError, match="'recommendation.split_fraction'"):
        load_config("movielens", ["recommendation.split_fraction=1.5"])
