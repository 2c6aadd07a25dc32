"""Recommendation on MovieLens ratings: the second task behind the same engine.

Data: a MovieLens folder (``data.dir``: ratings.csv, u.data or ratings.dat) or, with ``data.dir``
empty, the built-in generated dataset (about ml-latest-small's size). Models: matrix
factorization with biases (``model.arch=mf``) or NCF (``ncf``). Objectives
(``recommendation.objective``): explicit ratings, scored by RMSE and MAE next to the global-mean
baseline; implicit feedback with ``recommendation.negatives`` sampled negatives per positive, scored
by HR@10 and NDCG@10 over ``recommendation.eval_negatives`` + 1 candidates next to the popularity
baseline. The task's own keys: the ``recommendation`` section (recommendation_settings.py).

Every metric comes from float64 sums over every validation rating (explicit) or held-out item
(implicit) exactly once, whatever the number of ranks (``ShardedSampler`` without padding).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...comm import dist
from ...config import Config
from ...data import DataError
from ...data.demo import cache_root
from ...data.loaders import Loaders
from ...data.ratings.batches import ExplicitRatings, ImplicitPairs, PairSet, RankedCandidates, SampledBatches
from ...data.ratings.movielens import GENERATED_VERSION, Split, ensure_generated_dataset, load_split
from ...data.sampler import ShardedSampler
from ...ownership import PRIVATE, folder_problem, replace_file
from ..base import DataEnv, Task
from .models import NCF, MatrixFactorization, parse_layers
from .settings import RecommendationSettings

EXPLICIT_FIELDS = ("loss_sum", "squared_error", "absolute_error", "baseline_squared_error",
                   "baseline_absolute_error", "count")
IMPLICIT_FIELDS = ("loss_sum", "hits", "ndcg", "baseline_hits", "baseline_ndcg", "ranked", "count")
TOP_K = 10


def ranking_sums(scores: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits@k and NDCG@k summed over rows whose column 0 is the held-out item.

    The item's rank is the number of candidates scored strictly higher: a tie counts in the held-out
    item's favour (this flatters the popularity baseline, whose counts tie often).
    """
    rank = (scores[:, 1:] > scores[:, :1]).sum(dim=1)
    hit = rank < k
    ndcg = torch.where(hit, 1.0 / torch.log2(rank.double() + 2.0), torch.zeros((), dtype=torch.float64,
                                                                               device=scores.device))
    return hit.double().sum(), ndcg.sum()


# Regularization of the user+item bias baseline (Koren 2010, section 2.1; Surprise's BaselineOnly
# ALS defaults: reg_i 10, reg_u 15, 10 rounds).
BIAS_REG_ITEM, BIAS_REG_USER, BIAS_ROUNDS = 10.0, 15.0, 10


def fit_biases(users: np.ndarray, items: np.ndarray, ratings: np.ndarray, num_users: int, num_items: int,
               mean: float) -> tuple[np.ndarray, np.ndarray]:
    """The baseline predictor mean + b_u + b_i, fitted by alternating regularized least squares
    (the predictor a matrix factorization must beat: it knows who rates high and what is liked)."""
    residual = ratings.astype(np.float64) - mean
    user_count = np.bincount(users, minlength=num_users)
    item_count = np.bincount(items, minlength=num_items)
    b_user, b_item = np.zeros(num_users), np.zeros(num_items)
    for _ in range(BIAS_ROUNDS):
        b_item = np.bincount(items, residual - b_user[users], minlength=num_items) / (BIAS_REG_ITEM + item_count)
        b_user = np.bincount(users, residual - b_item[items], minlength=num_users) / (BIAS_REG_USER + user_count)
    return b_user, b_item


def bias_baseline(split: Split, mean: float) -> dict[str, float]:
    """RMSE and MAE of the user+item bias baseline on the validation split (fitted on the training
    split; a user or item seen only in validation gets a bias of 0)."""
    ratings, train, val = split.ratings, split.train_index, split.val_index
    b_user, b_item = fit_biases(ratings.users[train], ratings.items[train], ratings.ratings[train],
                                ratings.num_users, ratings.num_items, mean)
    error = mean + b_user[ratings.users[val]] + b_item[ratings.items[val]] - ratings.ratings[val].astype(np.float64)
    return {"bias_baseline_rmse": float(np.sqrt(np.mean(error ** 2))),
            "bias_baseline_mae": float(np.mean(np.abs(error)))}


def summarize_explicit(sums: torch.Tensor) -> dict[str, float]:
    loss, squared, absolute, base_squared, base_absolute, count = (float(v) for v in sums)
    if count == 0:
        return {"loss": float("nan"), "rmse": float("nan"), "mae": float("nan"), "samples": 0}
    return {"loss": loss / count, "rmse": math.sqrt(squared / count), "mae": absolute / count,
            "baseline_rmse": math.sqrt(base_squared / count), "baseline_mae": base_absolute / count,
            "samples": int(round(count))}


def summarize_implicit(sums: torch.Tensor) -> dict[str, float]:
    loss, hits, ndcg, base_hits, base_ndcg, ranked, count = (float(v) for v in sums)
    metrics: dict[str, float] = {"loss": loss / count if count else float("nan"), "samples": int(round(count))}
    if ranked:
        metrics.update(hr10=hits / ranked, ndcg10=ndcg / ranked, baseline_hr10=base_hits / ranked,
                       baseline_ndcg10=base_ndcg / ranked)
    return metrics


class IdMap:
    """The raw user and movie ids behind the embedding rows, carried in checkpoints: a run resumed
    or evaluated on other ratings (whose rows would mean other users) stops with one line."""

    def __init__(self, user_ids: np.ndarray, item_ids: np.ndarray, source: str):
        self.user_ids, self.item_ids = torch.from_numpy(user_ids.copy()), torch.from_numpy(item_ids.copy())
        self.source = source

    def state_dict(self) -> dict[str, Any]:
        return {"user_ids": self.user_ids, "item_ids": self.item_ids, "source": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("user_ids", "item_ids"):
            if not torch.equal(state[key], getattr(self, key)):
                kind = "user" if key == "user_ids" else "movie"
                raise DataError(f"the checkpoint's model was trained on other ratings ({state['source']}: "
                                f"{len(state[key])} {kind}s) than data.dir gives ({self.source}: "
                                f"{len(getattr(self, key))} {kind}s); point data.dir at the same ratings")


def save_id_map(run_dir: Path, id_map: IdMap, share: str = PRIVATE) -> None:
    """``<output.dir>/movielens_ids.npz``: the raw id of each embedding row (index = row), for using
    the trained embeddings outside hvdtrain. Checkpoints carry the same mapping. Written only into a
    run folder training made and checked (hvdtrain/ownership.py), never through a link: evaluation,
    whose output.dir is what a checkpoint recorded, makes and writes nothing there."""
    if not run_dir.is_dir() or folder_problem(run_dir, share) is not None:
        return
    replace_file(run_dir / "movielens_ids.npz",
                 lambda handle: np.savez(handle, user_ids=id_map.user_ids.numpy(), item_ids=id_map.item_ids.numpy()),
                 share)


class Recommendation(Task):
    name = "recommendation"
    settings_class = RecommendationSettings
    sum_fields = EXPLICIT_FIELDS
    # Both objectives' metrics: a run reports one set or the other. The baselines are reported to
    # compare with, and have a direction too.
    metric_directions = {"loss": "min", "rmse": "min", "mae": "min", "baseline_rmse": "min", "baseline_mae": "min",
                         "bias_baseline_rmse": "min", "bias_baseline_mae": "min",
                         "hr10": "max", "ndcg10": "max", "baseline_hr10": "max", "baseline_ndcg10": "max"}
    best_metric = "rmse"
    higher_is_better = False
    unit = "samples"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.implicit = self.settings.objective == "implicit"
        if self.implicit:
            self.sum_fields, self.best_metric, self.higher_is_better = IMPLICIT_FIELDS, "hr10", True
        self.split: Split | None = None
        self.global_mean = 0.0
        self.references: dict[str, float] = {}
        self.model: torch.nn.Module | None = None
        self.id_map: IdMap | None = None

    # --- data ------------------------------------------------------------------------------------

    def dataset_folder(self, env: DataEnv) -> Path:
        if self.cfg.data.dir:
            return Path(self.cfg.data.dir).expanduser()
        with env.local_rank_zero_first():
            return ensure_generated_dataset(cache_root() / "datasets" / f"movielens-{GENERATED_VERSION}")

    def build_loaders(self, env: DataEnv) -> Loaders:
        cfg, data = self.cfg, self.settings
        folder = self.dataset_folder(env)
        # One process per host parses and writes the cache; the others then read it.
        with env.local_rank_zero_first():
            split = load_split(folder, data.split, data.split_fraction, cfg.seed, data.on_bad_line,
                               cache=data.ratings_cache, fallback_cache=cache_root(),
                               warn=dist.log if env.rank == 0 else None)
        self.split = split
        ratings = split.ratings
        train, val = split.train_index, split.val_index
        if len(val) == 0:
            raise DataError(f"{split.source}: no validation ratings with recommendation.split={data.split} "
                            f"(every user has a single rating?); use recommendation.split=random")
        self.global_mean = float(ratings.ratings[train].astype(np.float64).mean())
        self.references = {} if self.implicit else bias_baseline(split, self.global_mean)
        self.id_map = IdMap(ratings.user_ids, ratings.item_ids, str(split.source))
        if env.rank == 0:
            save_id_map(Path(cfg.output.dir), self.id_map, cfg.output.share)
        users, items = ratings.users, ratings.items
        if self.implicit:
            train_pairs = PairSet(users[train], items[train], ratings.num_items)
            all_pairs = PairSet(users, items, ratings.num_items)
            popularity = np.bincount(items[train], minlength=ratings.num_items)
            train_set = ImplicitPairs(users[train], items[train], data.negatives, train_pairs, cfg.seed)
            val_set = RankedCandidates(users[val], items[val], data.eval_negatives, all_pairs, cfg.seed, popularity)
        else:
            train_set = ExplicitRatings(users[train], items[train], ratings.ratings[train])
            val_set = ExplicitRatings(users[val], items[val], ratings.ratings[val])
        batch = cfg.train.batch_size
        train_sampler = ShardedSampler(len(train_set), env.world_size, env.rank, seed=cfg.seed, shuffle=True, pad=True)
        val_sampler = ShardedSampler(len(val_set), env.world_size, env.rank, shuffle=False, pad=False)
        self.train_set = train_set
        return Loaders(SampledBatches(train_sampler, batch, not env.keep_partial_batches, train_set.batch),
                       SampledBatches(val_sampler, batch, False, val_set.batch), train_sampler,
                       len(train_set), len(val_set), val_sampler, note=self.data_note())

    def data_note(self) -> str:
        split = self.split
        assert split is not None
        ratings = split.ratings
        where = f"cache {split.cache_path}" if split.from_cache else f"parsed ({split.fmt})"
        skipped = f", {ratings.skipped} bad lines skipped" if ratings.skipped else ""
        return (f"ratings {split.source}: {len(ratings)} ratings, {ratings.num_users} users, {ratings.num_items} "
                f"items, {len(split.val_index)} for validation ({self.settings.split}); {where} in "
                f"{split.seconds:.2f}s{skipped}")

    def bench_batches(self, count: int, rank: int) -> list:
        """The first ``count`` training batches of this rank (real data: sparse gradients cost what the
        batches' rows make them cost), repeating the epoch if it is shorter."""
        cfg = self.cfg
        sampler = ShardedSampler(len(self.train_set), dist.size(), rank, seed=cfg.seed, shuffle=True, pad=True)
        loader = SampledBatches(sampler, cfg.train.batch_size, True, self.train_set.batch)
        if len(loader) == 0:
            raise DataError(f"hvdtrain bench: the training split has {len(self.train_set)} samples, too few for "
                            f"one batch of {cfg.train.batch_size} on each of {dist.size()} ranks")
        batches: list = []
        while len(batches) < count:
            batches.extend(loader)
        return batches[:count]

    # --- model and loss --------------------------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        assert self.split is not None
        cfg, ratings = self.settings, self.split.ratings
        sparse = cfg.sparse_embeddings
        if self.cfg.model.arch == "mf":
            # Explicit: start from the global mean; implicit: from a logit of 0.
            self.model = MatrixFactorization(ratings.num_users, ratings.num_items, cfg.embedding_dim, sparse,
                                             0.0 if self.implicit else self.global_mean)
        else:
            self.model = NCF(ratings.num_users, ratings.num_items, cfg.embedding_dim, parse_layers(cfg.mlp_layers),
                             sparse, 0.0 if self.implicit else self.global_mean)
        return self.model

    def state_components(self) -> dict[str, Any]:
        assert self.id_map is not None
        return {"movielens_ids": self.id_map}

    def to_device(self, batch: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        (users, items), targets = batch
        return (users.to(device), items.to(device)), targets.to(device, dtype=dtype)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        outputs = outputs.to(torch.promote_types(outputs.dtype, torch.float32))
        if not self.implicit:
            loss = F.mse_loss(outputs, targets.to(outputs.dtype))
        elif outputs.dim() == 2:  # ranked validation candidates: column 0 is the held-out positive
            labels = torch.zeros_like(outputs)
            labels[:, 0] = 1.0
            loss = F.binary_cross_entropy_with_logits(outputs, labels)
        else:
            loss = F.binary_cross_entropy_with_logits(outputs, targets.to(outputs.dtype))
        l2 = self.settings.embedding_l2
        if training and l2 > 0 and self.model is not None:
            loss = loss + l2 * self.model.penalty
        return loss

    def metric_sums(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = outputs.device
        count = torch.tensor(float(outputs.shape[0]), dtype=torch.float64, device=device)
        loss_sum = loss.detach().double() * count
        if not self.implicit:
            error = outputs.detach().double() - targets.double()
            baseline = self.global_mean - targets.double()
            return torch.stack([loss_sum, error.pow(2).sum(), error.abs().sum(), baseline.pow(2).sum(),
                                baseline.abs().sum(), count])
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if outputs.dim() == 1:  # training pairs: no ranking
            return torch.stack([loss_sum, zero, zero, zero, zero, zero, count])
        hits, ndcg = ranking_sums(outputs.detach().double())
        base_hits, base_ndcg = ranking_sums(targets.double())
        return torch.stack([loss_sum, hits, ndcg, base_hits, base_ndcg, count, count])

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        return summarize_implicit(sums) if self.implicit else summarize_explicit(sums)

    def reference_metrics(self) -> dict[str, Any]:
        # The split with every validation record: two runs' records say whether they compare.
        data = self.settings
        split = {"val_split": data.split, "val_split_seed": self.cfg.seed}
        if data.split == "random":
            split["val_split_fraction"] = data.split_fraction
        return {**self.references, **split}

    # --- reporting -------------------------------------------------------------------------------

    def describe(self, loaders: Loaders) -> str:
        assert self.split is not None
        cfg, own, ratings = self.cfg, self.settings, self.split.ratings
        model = f"{cfg.model.arch} ({own.objective}, dim {own.embedding_dim}" + \
            (f", mlp {own.mlp_layers}" if cfg.model.arch == "ncf" else "") + ")"
        gradients = ("sparse gradients as dense" if cfg.dist.sparse_as_dense else "sparse gradients (allgather)") \
            if own.sparse_embeddings else "dense gradients"
        samples = f"{loaders.train_size} train samples ({own.negatives} negatives per positive)" \
            if self.implicit else f"{loaders.train_size} train ratings"
        return (f"{model} over {ratings.num_users} users x {ratings.num_items} items, {samples} / "
                f"{loaders.val_size} val, {gradients}, {cfg.optim.name}")

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        if self.implicit:
            return (f"train loss {train['loss']:.4f} | val HR@10 {val['hr10']:.4f} NDCG@10 {val['ndcg10']:.4f} "
                    f"(popularity: HR@10 {val['baseline_hr10']:.4f} NDCG@10 {val['baseline_ndcg10']:.4f})")

        def lower(reference: str) -> str:
            if not val.get(reference):
                return "n/a"
            change = 100 * (1 - val["rmse"] / val[reference])
            return f"{change:.1f}% lower" if change >= 0 else f"{-change:.1f}% higher"
        line = (f"train loss {train['loss']:.4f} rmse {train['rmse']:.4f} | val RMSE {val['rmse']:.4f} "
                f"MAE {val['mae']:.4f} (global mean: RMSE {val['baseline_rmse']:.4f} MAE {val['baseline_mae']:.4f}, "
                f"{lower('baseline_rmse')}")
        if "bias_baseline_rmse" in val:
            line += (f"; user+item biases: RMSE {val['bias_baseline_rmse']:.4f} MAE {val['bias_baseline_mae']:.4f}, "
                     f"{lower('bias_baseline_rmse')}")
        return line + ")"

    def checkpoint_metadata(self) -> dict[str, Any]:
        ratings = self.split.ratings if self.split is not None else None
        own = self.settings
        return {"arch": self.cfg.model.arch, "objective": own.objective,
                "num_users": ratings.num_users if ratings else 0, "num_items": ratings.num_items if ratings else 0,
                "global_mean": self.global_mean, "val_split": own.split, "val_split_seed": self.cfg.seed,
                "val_split_fraction": own.split_fraction if own.split == "random" else None}
