"""The recommender's user+item bias baseline (mean + b_u + b_i, regularized alternating least
squares): it recovers planted biases and beats the global mean by what they explain."""

from __future__ import annotations

import numpy as np

from hvdtrain.tasks.recommendation.task import fit_biases


def planted(seed: int = 0, users: int = 300, items: int = 200, ratings: int = 30000, noise: float = 0.5):
    rng = np.random.default_rng(seed)
    b_user, b_item = rng.normal(0, 0.6, users), rng.normal(0, 0.8, items)
    u, i = rng.integers(0, users, ratings), rng.integers(0, items, ratings)
    r = 3.5 + b_user[u] + b_item[i] + rng.normal(0, noise, ratings)
    return u, i, r, b_user, b_item


def test_planted_biases_are_recovered():
    u, i, r, b_user, b_item = planted()
    fitted_user, fitted_item = fit_biases(u, i, r, len(b_user), len(b_item), float(r.mean()))
    # Regularization shrinks every bias a little towards 0; 100-150 ratings each keep it small.
    assert np.corrcoef(fitted_user, b_user)[0, 1] > 0.95 and np.corrcoef(fitted_item, b_item)[0, 1] > 0.97
    assert abs(np.mean(fitted_user + 3.5 - r.mean()) - np.mean(b_user)) < 0.15


def test_the_bias_baseline_beats_the_global_mean_on_held_out_ratings():
    u, i, r, b_user, b_item = planted(seed=1)
    train, val = slice(0, 27000), slice(27000, None)
    mean = float(r[train].mean())
    fitted_user, fitted_item = fit_biases(u[train], i[train], r[train], len(b_user), len(b_item), mean)
    bias_rmse = np.sqrt(np.mean((mean + fitted_user[u[val]] + fitted_item[i[val]] - r[val]) ** 2))
    mean_rmse = np.sqrt(np.mean((mean - r[val]) ** 2))
    assert bias_rmse < 0.56 < 0.9 < mean_rmse  # near the noise (0.5) against sqrt(0.5^2 + 0.6^2 + 0.8^2)


def test_users_and_items_without_training_ratings_get_no_bias():
    u, i, r = np.array([0, 0, 1]), np.array([0, 1, 0]), np.array([5.0, 4.0, 3.0])
    fitted_user, fitted_item = fit_biases(u, i, r, 3, 3, 4.0)
    assert fitted_user[2] == 0 and fitted_item[2] == 0
