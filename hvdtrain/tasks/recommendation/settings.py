"""The recommendation task's own settings: the config section ``recommendation``.

``recommendation.embedding_dim=64`` on the command line, or in YAML::

    task: recommendation
    recommendation:
      objective: implicit
      negatives: 4

Before these keys had a section of their own they lived in ``model`` and ``data``
(``model.embedding_dim``, ``data.negatives``): a config that still says so stops with one line naming
the new key (config/root.py, MOVED_KEYS), and a checkpoint written then is read with them carried
over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...config.keys import ConfigError

# model.arch values of the recommendation task (recommender_models.py).
RECOMMENDERS = ("mf", "ncf")
# Far above real use, as config/checks.py's UPPER_BOUNDS: beyond them a typo allocated for minutes.
UPPER_BOUNDS = {"embedding_dim": (65536, "factors per row; recommenders use tens to hundreds"),
                "negatives": (1000, "per positive; He et al. 2017 use 4"),
                "eval_negatives": (100_000, "per held-out item; the usual protocol ranks 100")}
MAX_MLP_WIDTH = 65536  # units in one NCF layer (He et al. 2017 use up to 256)


@dataclass
class RecommendationSettings:
    objective: Literal["explicit", "implicit"] = "explicit"
    """explicit = predict ratings (MSE; RMSE, MAE); implicit = rated or not (BCE with sampled negatives; HR@10,
    NDCG@10)."""
    embedding_dim: int = 32
    """Factors per user and item (MF), the GMF branch's width (NCF)."""
    mlp_layers: str = "64,32,16"
    """NCF: MLP widths, the first = the two MLP embeddings concatenated."""
    embedding_l2: float = 0.0
    """L2 penalty on the embedding rows and biases a batch uses, added to the loss (works with sparse gradients, unlike
    optim.weight_decay)."""
    sparse_embeddings: bool = False
    """Embeddings produce sparse gradients, sent through Horovod's sparse path (allgather) unless
    dist.sparse_as_dense."""
    split: Literal["leave_last_out", "random"] = "leave_last_out"
    """Validation = each user's latest rating (leave_last_out, He et al. 2017) or a seeded random
    recommendation.split_fraction of the ratings."""
    split_fraction: float = 0.1
    """recommendation.split=random: the fraction of ratings held out for validation."""
    negatives: int = 4
    """Implicit: sampled negatives per positive in training, drawn from (seed, epoch, index)."""
    eval_negatives: int = 100
    """Implicit: items the user never rated ranked against each held-out one (HR@10, NDCG@10)."""
    on_bad_line: Literal["fail", "skip"] = "fail"
    """A malformed ratings line: fail = stop, naming the file and line; skip = count and skip it."""
    ratings_cache: bool = True
    """Cache the parsed and split ratings next to the source (or under $HVDTRAIN_CACHE); rebuilt when the source
    changes."""

    def validate(self, cfg: Any) -> None:
        """Each problem in one line (config/load.py calls this after the core checks)."""
        if cfg.model.arch not in RECOMMENDERS:
            raise ConfigError(f"config key 'model.arch': task=recommendation takes {' or '.join(RECOMMENDERS)}, "
                              f"got '{cfg.model.arch}' (e.g. --config movielens or model.arch=mf)")
        for key in ("embedding_dim", "negatives", "eval_negatives"):
            value, (bound, unit) = getattr(self, key), UPPER_BOUNDS[key]
            if not 0 < value <= bound:
                raise ConfigError(f"config key 'recommendation.{key}' must be positive and at most {bound} ({unit}), "
                                  f"got {value}")
        if not 0 < self.split_fraction < 1:
            raise ConfigError(f"config key 'recommendation.split_fraction' must be between 0 and 1, "
                              f"got {self.split_fraction}")
        if self.embedding_l2 < 0:
            raise ConfigError(f"config key 'recommendation.embedding_l2' must be >= 0, got {self.embedding_l2}")
        widths = self.mlp_layers.split(",")
        if not all(part.strip().isdigit() and 0 < int(part) <= MAX_MLP_WIDTH for part in widths) or len(widths) > 64:
            raise ConfigError(f"config key 'recommendation.mlp_layers': expected up to 64 positive widths of at most "
                              f"{MAX_MLP_WIDTH}, separated by commas, e.g. 64,32,16, got '{self.mlp_layers[:80]}'")
        if self.sparse_embeddings:
            if cfg.optim.name == "adam":
                raise ConfigError("recommendation.sparse_embeddings=true needs optim.name=sgd or adagrad (torch's Adam "
                                  "takes no sparse gradients), or set recommendation.sparse_embeddings=false")
            if cfg.optim.weight_decay > 0:
                raise ConfigError("recommendation.sparse_embeddings=true needs optim.weight_decay=0 (torch applies no "
                                  "weight decay to sparse gradients): regularize with recommendation.embedding_l2 "
                                  "instead")
            if cfg.dist.engine == "torch" and not cfg.dist.sparse_as_dense:
                raise ConfigError("recommendation.sparse_embeddings=true with dist.engine=torch needs "
                                  "dist.sparse_as_dense=true (the torch engine averages gradients dense; Horovod's "
                                  "sparse allgather is dist.engine=horovod's)")
            if cfg.dist.bucket_mb > 0:
                raise ConfigError(f"dist.bucket_mb={cfg.dist.bucket_mb:g} cannot be used with "
                                  "recommendation.sparse_embeddings=true (Horovod's grouped allreduce takes no sparse "
                                  "gradients): leave dist.bucket_mb at -1 (auto) or 0")
