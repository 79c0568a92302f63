"""Randomized parity of the parallel strategies against one process, on seeded ODD configurations.

The library's rule: every parallel strategy trained on each rank's shard of a global batch ends where one
process training the same model (same seed, same data) on the whole batch ends, to ~1e-12 relative in
float64, or the configuration is refused up front with a clear error on every rank. This module draws, from
a seed and the world size, configurations the fixed cases do not: tiny widths (parameters with fewer
elements than ranks, 1-element biases, widths that no world size or tp divides), several layers, LayerNorms,
(B, T, d) inputs, a parameter never used in forward, a 1-element parameter of the model itself, weight tying
(a second Linear holding a square Linear's Parameters), "frozen" parameters (left out of the optimizer: the
API has no ``requires_grad``), SGD (momentum, dampening, Nesterov, weight decay) / Adam / AdamW, a learning
rate changed mid-run, gradient clipping (p = 0.5, 1, 2, 3, inf), gradient accumulation, backward without the
input gradient, and per strategy:

- ``ddp``: bucket sizes from one byte to 25 MiB, OVERLAPPED / SYNCHRONOUS / NO_SYNC (+ ``sync_gradients``),
  bucket views on or off, ``no_sync`` accumulation, ``find_unused_parameters`` (an unused parameter without
  it must be refused with ``UnusedParameterError`` on every rank), ``zero_grad(set_to_none=True)``; a tie
  under OVERLAPPED may be refused (``GradientAfterReductionError``, docs/ddp.md) or match;
- ``zero1``: the same under ``ZeroRedundancyOptimizer``, over all or some (unfrozen) parameters;
- ``fsdp``: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (every ``ranks_per_node`` dividing the world;
  one that does not must be refused), default units, one unit per layer, a random subset (the rest in the
  root unit; a tie across units must be refused), prefetch 0-2, every ``cpu_offload`` (no-ops on the host);
- ``tp``: Column/Row parallel layers (gather_output, input_is_parallel both ways) and TensorParallelAttention
  between plain layers, on a tp group of the whole world, of a dp x tp mesh under DDP (with or without
  ZeRO-1 over dp), or of a pp=2 x tp=2 mesh in a pipeline; a width or head count tp does not divide must be
  refused with ``ConfigurationError`` naming the numbers on every rank;
- ``pipeline``: GPipe, 1F1B, interleaved 1F1B, ``from_modules`` or ``from_stages``, random cuts into stages
  (some without parameters), ties across stages, gradients accumulated over several ``train_step`` calls,
  micro-batch counts that do or do not divide the batch (the latter refused on every rank, naming both
  numbers), interleaving with m not a multiple of P, several stages per rank without interleaving, a stage
  count the world does not divide (all refused), and ``dp_group`` on a dp x pp mesh.

Each case ``case_<strategy>_<seed>`` draws its configuration from ``(seed, strategy, world size)`` (the same
on every rank), runs it, and asserts on every rank either parity (``TOL`` relative and absolute) with the
one-process reference, or the predicted refusal. ``AXONHPC_FUZZ_SEEDS`` picks the seeds: a count (``50``:
0-49) or a range (``100-199``) or a comma list; the default is a few fixed ones. ``fuzz_config(strategy,
seed, n)`` returns a configuration as a plain dict, for printing a reproducer; ``KNOWN_BUGS`` lists the
library bugs found so far, by the configurations they show in.
"""
import os
import re

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import AxonError

TOL = 1e-10
DEFAULT_SEEDS = tuple(range(10)) + (22, 80, 87)  # 22 (fsdp) and 80, 87 (pipeline) show known bugs too
STRATEGIES = ("ddp", "zero1", "fsdp", "tp", "pipeline")


def seeds_from_env():
    text = os.environ.get("AXONHPC_FUZZ_SEEDS", "").strip()
    if not text:
        return DEFAULT_SEEDS
    if "-" in text:
        lo, hi = text.split("-")
        return tuple(range(int(lo), int(hi) + 1))
    if "," in text:
        return tuple(int(s) for s in text.split(","))
    return tuple(range(int(text)))


# ----------------------------------------------------------------------------------------------------------------
# models

class Net(nn.Module):
    """``body`` (a Sequential); optionally ``spare``, a Linear that forward never calls, and ``scale``, a
    1-element Parameter of the model itself (FSDP's root unit) multiplying the output."""

    def __init__(self, layers, spare=None, scale=None):
        super().__init__()
        if scale is not None:
            self.scale = nn.Parameter(np.array([scale], dtype=np.float64))
        self.body = nn.Sequential(*layers)
        if spare is not None:
            self.spare = spare

    def forward(self, x):
        h = self.body(x)
        if getattr(self, "scale", None) is None:
            return h
        self._save_cache(h)
        return h * self.scale.data

    def backward(self, g, input_grad=True):
        if getattr(self, "scale", None) is not None:
            h = self._pop_cache()
            self.scale.accumulate_grad(np.array([np.sum(g * h)]))
            g = g * self.scale.data
        return nn.call_backward(self.body.backward, g, input_grad)


def _act(name):
    return {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}[name]()


def build_dense(spec, seed):
    """The plain model of ``spec``: Linear/LayerNorm/activation layers; parameter seeds offset by ``seed``."""
    layers = []
    for kind, *args in spec["layers"]:
        if kind == "linear":
            fan_in, fan_out, bias, s = args
            layers.append(nn.Linear(fan_in, fan_out, bias=bias, dtype=np.float64, seed=seed + s))
        elif kind == "attn":
            embed, heads, bias, causal, s = args
            layers.append(nn.MultiHeadAttention(embed, heads, bias=bias, causal=causal, dtype=np.float64,
                                                seed=seed + s))
        elif kind == "tie":  # another Linear holding the very same Parameters (weight tying)
            source = layers[args[0]]
            tied = nn.Linear(source.in_features, source.out_features, bias=source.bias is not None,
                             dtype=np.float64, seed=0)
            tied.weight = source.weight
            if source.bias is not None:
                tied.bias = source.bias
            layers.append(tied)
        elif kind == "norm":
            (width,) = args
            norm = nn.LayerNorm(width, dtype=np.float64)
            rng = np.random.default_rng(seed + 77)  # not the default ones/zeros: the ranks must be told
            norm.weight.data[...] = 1 + 0.1 * rng.standard_normal(width)
            norm.bias.data[...] = 0.1 * rng.standard_normal(width)
            layers.append(norm)
        else:
            layers.append(_act(kind))
    spare = None
    if spec.get("spare"):
        fan_in, fan_out = spec["spare"]
        spare = nn.Linear(fan_in, fan_out, dtype=np.float64, seed=seed + 999)
    return Net(layers, spare, spec.get("scale"))


def _draw_mlp(rng, d_in, d_out, n_linear, max_width=9, norm=True, tie=True):
    """A layer spec: n_linear Linears from d_in to d_out through random (often tiny) widths; sometimes a second
    Linear shares the Parameters of a square one (``("tie", index)``: weight tying)."""
    widths = [d_in] + [int(rng.integers(1, max_width + 1)) for _ in range(n_linear - 1)] + [d_out]
    tied = int(rng.integers(0, n_linear - 1)) if tie and n_linear > 1 and rng.random() < 0.25 else None
    if tied is not None:
        widths[tied + 1] = widths[tied]
    layers = []
    for i in range(n_linear):
        layers.append(("linear", widths[i], widths[i + 1], bool(rng.random() < 0.8), 10 * i + 1))
        at = len(layers) - 1
        if i < n_linear - 1:
            if norm and rng.random() < 0.25:
                layers.append(("norm", widths[i + 1]))
            layers.append((str(rng.choice(["tanh", "relu", "gelu"])),))
        if i == tied:
            layers += [("tie", at), (str(rng.choice(["tanh", "relu", "gelu"])),)]
    return layers


def has_tie(spec):
    return any(layer[0] == "tie" for layer in spec["layers"])


# ----------------------------------------------------------------------------------------------------------------
# optimizers, data, loss

def _draw_optimizer(rng):
    kind = str(rng.choice(["sgd", "sgd", "adam", "adamw"]))
    if kind == "sgd":
        momentum = float(rng.choice([0.0, 0.5, 0.9]))
        nesterov = bool(momentum > 0 and rng.random() < 0.5)
        dampening = 0.0 if nesterov or rng.random() < 0.7 else 0.3
        return {"kind": "sgd", "lr": float(rng.choice([0.05, 0.2])), "momentum": momentum, "nesterov": nesterov,
                "dampening": dampening, "weight_decay": float(rng.choice([0.0, 1e-3, 0.1]))}
    return {"kind": kind, "lr": float(rng.choice([1e-3, 1e-2, 5e-2])),
            "weight_decay": float(rng.choice([0.0, 1e-2, 0.1]))}


class _NoOptimizer:
    """What a rank holding no trainable parameter steps (the optimizers refuse an empty list)."""

    def zero_grad(self, set_to_none=False):
        pass

    def step(self):
        pass


def make_optimizer(spec, params):
    params = list(params)
    if not params:
        return _NoOptimizer()
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    return {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}[spec["kind"]](params, **kwargs)


def optimizer_class(spec):
    return {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}[spec["kind"]], \
        {k: v for k, v in spec.items() if k != "kind"}


def _draw_clip(rng):
    if rng.random() < 0.5:
        return None
    return {"max_norm": float(rng.choice([0.01, 0.1, 1.0])), "norm_type": float(rng.choice([0.5, 1.0, 2.0, 3.0, np.inf]))}


def make_batch(cfg, step, micro):
    """The global batch of ``(step, micro)``: x (B, d_in) float64, y per the loss."""
    rng = np.random.default_rng([cfg["seed"], 7, step, micro])
    lead = (cfg["batch"],) + ((cfg["seq"],) if cfg.get("seq") else ())
    x = rng.standard_normal(lead + (cfg["d_in"],))
    if cfg["loss"] == "ce":
        y = rng.integers(0, cfg["d_out"], lead)
    else:
        y = rng.standard_normal(lead + (cfg["d_out"],))
    return x, y


def make_loss(cfg):
    return nn.CrossEntropyLoss() if cfg["loss"] == "ce" else nn.MSELoss()


def shard(a, rank, n):
    k = len(a) // n
    return a[rank * k:(rank + 1) * k]


def _train_wrapped(cfg, wrapper, opt, r, n, clip, sync=None, local_steps=True):
    """``cfg``'s steps through a DDP or FSDP ``wrapper``, on part ``r`` of ``n`` of each batch: each step's
    micro-batches (all but the last under ``no_sync()`` when ``local_steps``), ``sync()`` after them if given
    (``NO_SYNC``), clipping with ``clip``, then the optimizer."""
    loss_fn = make_loss(cfg)
    for step in range(cfg["steps"]):
        _decay(opt, cfg, step)
        opt.zero_grad(set_to_none=cfg["set_to_none"])
        for micro in range(cfg["accumulate"]):
            x, y = make_batch(cfg, step, micro)
            loss_fn(wrapper(shard(x, r, n)), shard(y, r, n))
            if local_steps and micro < cfg["accumulate"] - 1:
                with wrapper.no_sync():
                    _backward(wrapper, loss_fn.backward(), cfg)
            else:
                _backward(wrapper, loss_fn.backward(), cfg)
        if sync is not None:
            sync()
        _clip(cfg, clip)
        opt.step()


def _frozen(params, names, frozen):
    return [p for p, name in zip(params, names) if name not in frozen]


def _frozen_positions(cfg):
    """Positions, in the dense model's parameter order, of the parameters left out of the optimizer."""
    if not cfg.get("frozen"):
        return set()
    return {k for k, name in enumerate(_param_names(cfg)) if name in cfg["frozen"]}


# ----------------------------------------------------------------------------------------------------------------
# the one-process reference

def train_reference(cfg, model=None):
    model = build_dense(cfg["model"], 0) if model is None else model
    frozen = _frozen_positions(cfg)
    opt = make_optimizer(cfg["optimizer"], [p for k, p in enumerate(model.parameters()) if k not in frozen])
    loss_fn = make_loss(cfg)
    for step in range(cfg["steps"]):
        _decay(opt, cfg, step)
        opt.zero_grad(set_to_none=cfg.get("set_to_none", False))
        for micro in range(cfg["accumulate"]):
            x, y = make_batch(cfg, step, micro)
            loss_fn(model(x), y)
            _backward(model, loss_fn.backward(), cfg)
        if cfg["clip"]:
            optim.clip_grad_norm(model.parameters(), cfg["clip"]["max_norm"], cfg["clip"]["norm_type"])
        opt.step()
    return model


def assert_close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, rtol=TOL, atol=TOL, err_msg=what)


# ----------------------------------------------------------------------------------------------------------------
# configurations

def _draw_common(rng, seed, strategy, n, allow_spare=True, allow_accumulate=True):
    d_in, d_out = int(rng.integers(1, 7)), int(rng.integers(1, 6))
    loss = "ce" if d_out >= 2 and rng.random() < 0.5 else "mse"
    n_linear = int(rng.integers(1, 5))
    spare = None
    if allow_spare and rng.random() < 0.3:
        spare = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    cfg = {
        "strategy": strategy, "seed": seed, "world": n, "d_in": d_in, "d_out": d_out, "loss": loss,
        "model": {"layers": _draw_mlp(rng, d_in, d_out, n_linear), "spare": spare},
        "optimizer": _draw_optimizer(rng), "clip": _draw_clip(rng),
        "steps": int(rng.integers(2, 5)),
        "accumulate": int(rng.integers(1, 4)) if allow_accumulate and rng.random() < 0.4 else 1,
        "rows": int(rng.integers(1, 4)),  # per data-parallel rank
        "set_to_none": bool(rng.random() < 0.3),
        "seq": int(rng.integers(1, 4)) if rng.random() < 0.2 else None,  # inputs (B, T, d)
        "lr_decay_at": int(rng.integers(1, 3)) if rng.random() < 0.3 else None,  # opt.lr halved before it
        "input_grad": bool(rng.random() < 0.8),
    }
    if strategy in ("ddp", "zero1", "fsdp") and rng.random() < 0.25:
        cfg["model"]["scale"] = float(rng.choice([0.5, 1.5]))
    return cfg


def _param_names(cfg):
    return [name for name, _ in build_dense(cfg["model"], 0).named_parameters()]


def _draw_frozen(rng, cfg):
    names = _param_names(cfg)
    if len(names) > 1 and rng.random() < 0.3:
        k = int(rng.integers(1, len(names)))
        return tuple(sorted(str(s) for s in rng.choice(names, size=k, replace=False)))
    return ()


def _draw_ddp(rng, cfg, n):
    cfg["ddp"] = {
        "bucket_size_mb": float(rng.choice([1e-6, 1e-4, 5e-4, 1.0, 25.0])),
        "strategy": str(rng.choice(["OVERLAPPED", "SYNCHRONOUS", "OVERLAPPED", "SYNCHRONOUS", "NO_SYNC"])),
        "gradient_as_bucket_view": bool(rng.random() < 0.6),
        "find_unused_parameters": bool(rng.random() < 0.5) or (cfg["model"]["spare"] is not None
                                                              and rng.random() < 0.7),
    }
    cfg["frozen"] = _draw_frozen(rng, cfg)
    cfg["batch"] = n * cfg["rows"]
    reasons, may_match = [], True
    if cfg["model"]["spare"] is not None and not cfg["ddp"]["find_unused_parameters"]:
        reasons.append({"error": "UnusedParameterError", "names": ["spare.weight"]})
        # NO_SYNC: the user's sync_gradients() averages; the docs do not say whether it checks for unused ones
        may_match = cfg["ddp"]["strategy"] == "NO_SYNC"
    if has_tie(cfg["model"]) and cfg["ddp"]["strategy"] == "OVERLAPPED":
        # docs/ddp.md: a second gradient after its bucket may be on the wire raises under OVERLAPPED
        reasons.append({"error": "GradientAfterReductionError"})
    if reasons:
        cfg["expect"] = {"any_of": reasons, "may_match": may_match}


def fuzz_config(strategy, seed, n):
    """The configuration of ``case_<strategy>_<seed>`` at world size ``n`` (a plain dict)."""
    rng = np.random.default_rng([seed, STRATEGIES.index(strategy), n])
    if strategy in ("ddp", "zero1"):
        cfg = _draw_common(rng, seed, strategy, n)
        _draw_ddp(rng, cfg, n)
    elif strategy == "fsdp":
        cfg = _draw_common(rng, seed, strategy, n)
        kinds = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]
        fs = {"sharding_strategy": str(rng.choice(kinds)), "prefetch": int(rng.integers(0, 3)),
              "cpu_offload": str(rng.choice(["none", "none", "params", "optimizer_states", "full"])),
              "units": str(rng.choice(["default", "layers", "subset"]))}
        if fs["sharding_strategy"] == "hybrid_shard":
            fs["ranks_per_node"] = int(rng.choice([d for d in range(1, n + 1) if n % d == 0]))
            if n > 2 and rng.random() < 0.2:  # a block size that does not divide the world: refused
                fs["ranks_per_node"] = int(rng.choice([d for d in range(2, n) if n % d]))
        if fs["units"] == "subset":
            fs["subset_seed"] = int(rng.integers(0, 1 << 30))
        cfg["fsdp"] = fs
        cfg["batch"] = n * cfg["rows"]
        if fs.get("ranks_per_node") and n % fs["ranks_per_node"]:
            cfg["expect"] = {"error": "ConfigurationError", "numbers": [fs["ranks_per_node"]]}
        elif has_tie(cfg["model"]) and _tie_splits_units(cfg):
            # docs/fsdp.md: a parameter reachable from two units (or a unit and the root) is refused
            cfg["expect"] = {"error": "ConfigurationError", "may_match": True}
    elif strategy == "tp":
        cfg = _draw_common(rng, seed, strategy, n, allow_spare=False)
        dp = 2 if n == 4 and rng.random() < 0.4 else 1
        tp = n // dp
        cfg["mesh"] = {"dp": dp, "tp": tp, "zero1": bool(dp > 1 and rng.random() < 0.5)}
        cfg["batch"] = dp * cfg["rows"]
        cfg["frozen"] = ()
        cfg["model"] = {"layers": _draw_tp_layers(rng, cfg, tp), "spare": None}
        layers = cfg["model"]["layers"]
        if n == 4 and dp == 1 and rng.random() < 0.4:  # pp=2 x tp=2: stages of tensor-parallel layers
            v = 2 if rng.random() < 0.3 else 1
            if len(layers) >= 2 * v:
                cfg["mesh"] = {"dp": 1, "tp": 2, "pp": 2}
                m = 2 * int(rng.integers(1, 3)) if v == 2 else int(rng.integers(1, 4))
                cfg["rows"] = cfg["batch"] = m * int(rng.integers(1, 3))
                cuts = sorted(rng.choice(np.arange(1, len(layers)), size=2 * v - 1, replace=False).tolist())
                cfg["pipeline"] = {"schedule": "interleaved_1f1b" if v == 2 else str(rng.choice(["gpipe", "1f1b"])),
                                   "stages_per_rank": v, "m": m, "bounds": [0] + cuts + [len(layers)]}
                tp = 2
        cfg["model"]["layers"] = layers
        bad = _tp_refusal(cfg["model"]["layers"], tp)
        if bad is not None:
            cfg["expect"] = {"error": "ConfigurationError", "numbers": bad}
    else:
        cfg = _draw_common(rng, seed, strategy, n, allow_spare=False)  # accumulate: train_steps per step
        _draw_pipeline(rng, cfg, n)
    return cfg


# ---- tensor parallel

def _draw_tp_layers(rng, cfg, tp):
    """Column/Row pairs (split hidden width h), a column layer with gather_output, a row layer with a full input,
    between plain Linears. Widths are drawn as multiples of tp most of the time, else anything (refusal)."""
    def width():
        if rng.random() < 0.8:
            return tp * int(rng.integers(1, 4))
        return int(rng.integers(1, 10))

    layers, d, s = [], cfg["d_in"], 1
    blocks = int(rng.integers(1, 3))
    for b in range(blocks):
        last = b == blocks - 1
        out = cfg["d_out"] if last else int(rng.integers(1, 7))
        form = str(rng.choice(["pair", "gather", "row_full", "plain", "attn"]))
        if form == "attn":
            if not cfg.get("seq"):
                cfg["seq"] = int(rng.integers(1, 4))
            heads = tp * int(rng.integers(1, 3)) if rng.random() < 0.8 else int(rng.integers(1, 5))
            embed = heads * int(rng.integers(1, 3)) if rng.random() < 0.85 else int(rng.integers(1, 7))
            layers += [("linear", d, embed, True, s + 2), ("tanh",),
                       ("attn", embed, heads, bool(rng.random() < 0.7), bool(rng.random() < 0.5), s),
                       ("linear", embed, out, bool(rng.random() < 0.8), s + 1)]
        elif form == "pair":
            h = width()
            layers += [("column", d, h, bool(rng.random() < 0.8), s, False), (str(rng.choice(["tanh", "gelu"])),),
                       ("row", h, out, bool(rng.random() < 0.8), s + 1, True)]
        elif form == "gather":
            h = width()
            layers += [("column", d, h, bool(rng.random() < 0.8), s, True), ("tanh",),
                       ("linear", h, out, True, s + 1)]
        elif form == "row_full":
            h = width()
            layers += [("linear", d, h, True, s), ("tanh",), ("row", h, out, bool(rng.random() < 0.8), s + 1, False)]
        else:
            layers += [("linear", d, out, bool(rng.random() < 0.8), s)]
        if not last:
            layers.append(("tanh",))
        d, s = out, s + 10
    return layers


def _tp_refusal(layers, tp):
    for kind, *args in layers:
        if kind == "attn" and (args[0] % args[1] or args[1] % tp):
            return [args[0], args[1]] if args[0] % args[1] else [args[1], tp]
        if kind == "column" and args[1] % tp:
            return [args[1], tp]
        if kind == "row" and args[0] % tp:
            return [args[0], tp]
    return None


def _dense_spec(layers):
    out = []
    for kind, *args in layers:
        if kind in ("column", "row"):
            fan_in, fan_out, bias, s, _flag = args
            out.append(("linear", fan_in, fan_out, bias, s))
        else:
            out.append((kind, *args))
    return out


# ---- pipeline

def _draw_pipeline(rng, cfg, n):
    schedule = str(rng.choice(["gpipe", "1f1b", "interleaved_1f1b"]))
    dp = 2 if n == 4 and rng.random() < 0.3 else 1
    p = n // dp
    v = int(rng.integers(2, 4)) if schedule == "interleaved_1f1b" else (2 if rng.random() < 0.15 else 1)
    num_stages = p * v
    if rng.random() < 0.1 and p > 1:
        num_stages = p * v + int(rng.integers(1, p))  # the world does not divide the stage count
    m = int(rng.integers(1, 7))
    if schedule == "interleaved_1f1b" and rng.random() < 0.6:
        m = p * int(rng.integers(1, 3))
    rows = int(rng.integers(1, 4)) * m if rng.random() < 0.75 else int(rng.integers(1, 13))
    layers = _draw_mlp(rng, cfg["d_in"], cfg["d_out"], int(rng.integers(num_stages, num_stages + 4)), norm=True)
    # cut after activations (or anywhere) into num_stages non-empty stages
    cuts = sorted(rng.choice(np.arange(1, len(layers)), size=num_stages - 1, replace=False).tolist()) \
        if num_stages > 1 else []
    bounds = [0] + cuts + [len(layers)]
    cfg["model"] = {"layers": layers, "spare": None}
    cfg["pipeline"] = {"schedule": schedule, "stages_per_rank": v, "num_stages": num_stages, "m": m,
                       "dp": dp, "bounds": bounds,
                       # from_stages: each rank passes only its own stages (ties cannot be seen: from_modules)
                       "builder": "from_stages" if not has_tie(cfg["model"]) and rng.random() < 0.35
                       else "from_modules"}
    cfg["rows"] = rows
    cfg["batch"] = dp * rows
    cfg["frozen"] = _draw_frozen(rng, cfg)
    reasons = []  # every refusal the configuration deserves; the library may name any one of them
    if num_stages % p or num_stages // p != v:
        reasons.append({"error": "ConfigurationError", "numbers": [num_stages]})
    if schedule != "interleaved_1f1b" and v > 1:
        reasons.append({"error": "ConfigurationError", "numbers": [v]})
    if schedule == "interleaved_1f1b" and m % p:
        reasons.append({"error": "ConfigurationError", "numbers": [m, p]})
    if rows % m:
        reasons.append({"error": "ShapeError", "numbers": [rows, m]})
    if reasons:
        cfg["expect"] = {"any_of": reasons}


# ----------------------------------------------------------------------------------------------------------------
# runs

def _decay(opt, cfg, step):
    if step == cfg.get("lr_decay_at") and not isinstance(opt, _NoOptimizer):
        opt.lr = opt.lr * 0.5


def _backward(wrapper, g, cfg):
    if cfg.get("input_grad", True):
        return wrapper.backward(g)
    return wrapper.backward(g, input_grad=False)


def _clip(cfg, fn):
    if cfg["clip"]:
        fn(cfg["clip"]["max_norm"], cfg["clip"]["norm_type"])


def run_ddp(world, cfg):
    n, r = world.world_size, world.rank
    model = build_dense(cfg["model"], 0 if r == 0 else 1000 + r)  # DDP must take rank 0's values
    d = cfg["ddp"]
    ddp = ax.DDP(model, bucket_size_mb=d["bucket_size_mb"], strategy=getattr(ax.GradSyncStrategy, d["strategy"]),
                 gradient_as_bucket_view=d["gradient_as_bucket_view"],
                 find_unused_parameters=d["find_unused_parameters"])
    names = [name for name, _ in model.named_parameters()]
    params = _frozen(ddp.parameters(), names, cfg["frozen"])
    if cfg["strategy"] == "zero1":
        cls, kwargs = optimizer_class(cfg["optimizer"])
        opt = ax.ZeroRedundancyOptimizer(cls, params, **kwargs)
    else:
        opt = make_optimizer(cfg["optimizer"], params)
    _train_wrapped(cfg, ddp, opt, r, n, lambda c, p: ax.clip_grad_norm(ddp, c, p),
                   ddp.sync_gradients if d["strategy"] == "NO_SYNC" else None)
    reference = train_reference(cfg)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(p.data, q.data, f"{name} on rank {r}")


def _fsdp_units(model, fs):
    body = []
    for m in model.body:
        if m.parameters() and all(m is not b for b in body):
            body.append(m)
    if fs["units"] == "default":
        return None
    if fs["units"] == "layers":
        return body + ([model.spare] if hasattr(model, "spare") else [])
    rng = np.random.default_rng(fs["subset_seed"])
    candidates = body + ([model.spare] if hasattr(model, "spare") else [])
    k = int(rng.integers(0, len(candidates) + 1))
    chosen = sorted(rng.choice(len(candidates), size=k, replace=False).tolist())
    return [candidates[i] for i in chosen] if chosen else None


def _tie_splits_units(cfg):
    """Whether the two Linears sharing Parameters fall into different FSDP units (the root counting as one)."""
    model = build_dense(cfg["model"], 0)
    units = _fsdp_units(model, cfg["fsdp"])
    if units is None:  # the default: each child of the Net with parameters (body, spare)
        return False
    tied = next(layer for layer in cfg["model"]["layers"] if layer[0] == "tie")
    weight = model.body[tied[1]].weight
    homes = set()
    for mod in model.body:
        if getattr(mod, "weight", None) is weight:
            home = [k for k, unit in enumerate(units) if any(mod is m for m in unit.modules())]
            homes.add(home[0] if home else "root")
    return len(homes) > 1


def run_fsdp(world, cfg):
    n, r = world.world_size, world.rank
    model = build_dense(cfg["model"], 0 if r == 0 else 1000 + r)
    fs = cfg["fsdp"]
    kwargs = {"ranks_per_node": fs["ranks_per_node"]} if "ranks_per_node" in fs else {}
    fsdp = ax.FSDP(model, sharding_strategy=fs["sharding_strategy"], prefetch=fs["prefetch"],
                   cpu_offload=fs.get("cpu_offload", "none"),
                   units=_fsdp_units(model, fs), **kwargs)
    opt = make_optimizer(cfg["optimizer"], fsdp.parameters())
    _train_wrapped(cfg, fsdp, opt, r, n, fsdp.clip_grad_norm)
    full = fsdp.full_state_dict(rank0_only=False)
    reference = train_reference(cfg)
    for name, value in reference.state_dict().items():
        assert_close(full[name], value, f"{name} on rank {r}")


def _build_tp(layers, tp_group, seed):
    out = []
    for kind, *args in layers:
        if kind == "attn":
            embed, heads, bias, causal, s = args
            out.append(ax.TensorParallelAttention(embed, heads, group=tp_group, bias=bias, causal=causal,
                                                  dtype=np.float64, seed=seed + s))
        elif kind == "column":
            fan_in, fan_out, bias, s, gather = args
            out.append(ax.ColumnParallelLinear(fan_in, fan_out, group=tp_group, gather_output=gather, bias=bias,
                                               dtype=np.float64, seed=seed + s))
        elif kind == "row":
            fan_in, fan_out, bias, s, parallel = args
            out.append(ax.RowParallelLinear(fan_in, fan_out, group=tp_group, input_is_parallel=parallel, bias=bias,
                                            dtype=np.float64, seed=seed + s))
        elif kind == "linear":
            fan_in, fan_out, bias, s = args
            out.append(nn.Linear(fan_in, fan_out, bias=bias, dtype=np.float64, seed=seed + s))
        else:
            out.append(_act(kind))
    return nn.Sequential(*out)


def run_tp(world, cfg):
    if cfg["mesh"].get("pp", 1) > 1:
        return _run_tp_pipeline(world, cfg)
    dp, tp = cfg["mesh"]["dp"], cfg["mesh"]["tp"]
    if dp > 1:
        mesh = world.mesh(dp=dp, tp=tp)
        tp_group, dp_group, dp_rank = mesh.tp, mesh.dp, mesh.coords.dp
    else:
        tp_group, dp_group, dp_rank = world.default_group, None, 0
    model = _build_tp(cfg["model"]["layers"], tp_group, 0)
    wrapper = ax.DDP(model, group=dp_group, bucket_size_mb=1e-4) if dp > 1 else model
    params = wrapper.parameters()
    if cfg["mesh"].get("zero1"):  # ZeRO-1 over the data-parallel group DDP averages over
        cls, kwargs = optimizer_class(cfg["optimizer"])
        opt = ax.ZeroRedundancyOptimizer(cls, params, group=dp_group, **kwargs)
    else:
        opt = make_optimizer(cfg["optimizer"], params)
    _train_wrapped(cfg, wrapper, opt, dp_rank, dp, lambda c, p: ax.clip_grad_norm(wrapper, c, p),
                   local_steps=dp > 1)
    dense_cfg = dict(cfg, model={"layers": _dense_spec(cfg["model"]["layers"]), "spare": None})
    reference = train_reference(dense_cfg)
    for i, (spec, mine, ref) in enumerate(zip(cfg["model"]["layers"], model, reference.body)):
        _compare_tp_layer(cfg, i, spec, mine, ref, tp_group.rank, tp)


def _run_tp_pipeline(world, cfg):
    """pp x tp: the stages hold tensor-parallel layers over mesh.tp, the pipeline runs over mesh.pp."""
    mesh = world.mesh(tp=cfg["mesh"]["tp"], pp=cfg["mesh"]["pp"])
    pc, layers = cfg["pipeline"], cfg["model"]["layers"]
    model = _build_tp(layers, mesh.tp, 0)
    b = pc["bounds"]
    stages = [nn.Sequential(*list(model)[b[i]:b[i + 1]]) for i in range(len(b) - 1)]
    pipe = ax.Pipeline.from_modules(stages, group=mesh.pp, num_microbatches=pc["m"], schedule=pc["schedule"],
                                    loss_fn=make_loss(cfg), stages_per_rank=pc["stages_per_rank"])
    opt = make_optimizer(cfg["optimizer"], pipe.parameters())
    for step in range(cfg["steps"]):
        _decay(opt, cfg, step)
        opt.zero_grad(set_to_none=cfg["set_to_none"])
        for micro in range(cfg["accumulate"]):
            x, y = make_batch(cfg, step, micro)
            pipe.train_step(x, y)
        _clip(cfg, pipe.clip_grad_norm)
        opt.step()
    dense_cfg = dict(cfg, model={"layers": _dense_spec(layers), "spare": None})
    reference = train_reference(dense_cfg)
    mine = {k for s in pipe.stages for k in range(b[s], b[s + 1])}
    for i, (spec, layer, ref) in enumerate(zip(layers, model, reference.body)):
        if i in mine:
            _compare_tp_layer(cfg, i, spec, layer, ref, mesh.tp.rank, cfg["mesh"]["tp"])


def _compare_tp_layer(cfg, i, spec, mine, ref, t, k):
    """A tensor-parallel layer's shard on tp rank t of k against its dense layer's slice."""
    kind = spec[0]
    if kind == "attn":
        _, embed, heads, bias = spec[:4]
        rows = slice(t * heads // k * (embed // heads), (t + 1) * heads // k * (embed // heads))
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert_close(getattr(mine, proj).weight.data, getattr(ref, proj).weight.data[rows],
                         f"{i}.{proj}.weight (attention) on tp rank {t}")
            # The key bias adds the same q.b_k to every score of a query: softmax ignores it, so its true
            # gradient is 0 and what it gets is rounding noise (~1e-17), which Adam divides by sqrt(v) + eps
            # and so turns into steps of ~lr * noise / eps: values that no two summation orders share.
            if bias and not (proj == "k_proj" and cfg["optimizer"]["kind"] != "sgd"):
                assert_close(getattr(mine, proj).bias.data, getattr(ref, proj).bias.data[rows],
                             f"{i}.{proj}.bias (attention) on tp rank {t}")
        assert_close(mine.out_proj.weight.data, ref.out_proj.weight.data[:, rows],
                     f"{i}.out_proj.weight (attention) on tp rank {t}")
        if bias:
            assert_close(mine.out_proj.bias.data, ref.out_proj.bias.data, f"{i}.out_proj.bias on tp rank {t}")
    elif kind == "column":
        rows = slice(t * spec[2] // k, (t + 1) * spec[2] // k)
        assert_close(mine.weight.data, ref.weight.data[rows], f"{i}.weight (column) on tp rank {t}")
        if mine.bias is not None:
            assert_close(mine.bias.data, ref.bias.data[rows], f"{i}.bias (column) on tp rank {t}")
    elif kind == "row":
        cols = slice(t * spec[1] // k, (t + 1) * spec[1] // k)
        assert_close(mine.weight.data, ref.weight.data[:, cols], f"{i}.weight (row) on tp rank {t}")
        if mine.bias is not None:
            assert_close(mine.bias.data, ref.bias.data, f"{i}.bias (row) on tp rank {t}")
    elif kind == "linear":
        for name in ("weight", "bias"):
            if getattr(mine, name) is not None:
                assert_close(getattr(mine, name).data, getattr(ref, name).data, f"{i}.{name} on tp rank {t}")


def _pipeline_stages(cfg, seed):
    model = build_dense(cfg["model"], seed)
    layers = list(model.body)
    b = cfg["pipeline"]["bounds"]
    return [nn.Sequential(*layers[b[i]:b[i + 1]]) for i in range(len(b) - 1)]


def run_pipeline(world, cfg):
    pc = cfg["pipeline"]
    dp = pc["dp"]
    if dp > 1:
        mesh = world.mesh(dp=dp, pp=world.world_size // dp)
        pp_group, dp_group, dp_rank = mesh.pp, mesh.dp, mesh.coords.dp
    else:
        pp_group, dp_group, dp_rank = world.default_group, None, 0
    stages = _pipeline_stages(cfg, 0)
    if pc.get("builder") == "from_stages":
        p = pp_group.size
        own = [ax.PipelineStage(st, i, len(stages)) for i, st in enumerate(stages) if i % p == pp_group.rank]
        pipe = ax.Pipeline.from_stages(own, group=pp_group, num_microbatches=pc["m"], schedule=pc["schedule"],
                                       loss_fn=make_loss(cfg), dp_group=dp_group)
    else:
        pipe = ax.Pipeline.from_modules(stages, group=pp_group, num_microbatches=pc["m"], schedule=pc["schedule"],
                                        loss_fn=make_loss(cfg), stages_per_rank=pc["stages_per_rank"],
                                        dp_group=dp_group)
    mine = [(i, st) for i, st in enumerate(stages) if i in pipe.stages]
    # frozen: named in the dense model; the stages hold the same parameters in the same order
    flat = list({id(p): p for st in stages for p in st.parameters()}.values())  # a tied Parameter once
    frozen_ids = {id(flat[k]) for k in _frozen_positions(cfg)}
    params = [p for p in pipe.parameters() if id(p) not in frozen_ids]
    opt = make_optimizer(cfg["optimizer"], params)
    for step in range(cfg["steps"]):
        _decay(opt, cfg, step)
        opt.zero_grad(set_to_none=cfg["set_to_none"])
        for micro in range(cfg["accumulate"]):  # gradients accumulate over train_steps, as over backwards
            x, y = make_batch(cfg, step, micro)
            pipe.train_step(shard(x, dp_rank, dp), shard(y, dp_rank, dp))
        _clip(cfg, pipe.clip_grad_norm)
        opt.step()
    reference = _pipeline_stages(cfg, 0)
    train_reference(cfg, model=_as_net(reference))
    for i, st in mine:
        for (name, p), (_, q) in zip(st.named_parameters(), reference[i].named_parameters()):
            assert_close(p.data, q.data, f"stage {i} {name}")


def _as_net(stages):
    """A Net whose body runs the stages' layers in order, holding the very same layer objects."""
    net = Net([])
    net.body = nn.Sequential(*stages)
    return net


RUNS = {"ddp": run_ddp, "zero1": run_ddp, "fsdp": run_fsdp, "tp": run_tp, "pipeline": run_pipeline}


def run_config(world, cfg):
    """Run ``cfg`` on this rank: parity, or the predicted refusal (raises AssertionError otherwise)."""
    expect = cfg.get("expect")
    try:
        RUNS[cfg["strategy"]](world, cfg)
    except AxonError as exc:
        if expect is None:
            raise AssertionError(f"rank {world.rank}: a configuration that should train was refused: "
                                 f"{type(exc).__name__}: {exc}\nconfig: {cfg}") from exc
        _check_refusal(world, cfg, exc)
        return "refused"
    if expect is not None and not expect.get("may_match"):
        raise AssertionError(f"rank {world.rank}: expected a refusal ({expect}) but training went through\n"
                             f"config: {cfg}")
    return "matched"


def _check_refusal(world, cfg, exc):
    expect = cfg["expect"]
    problems = []
    for reason in expect.get("any_of", [expect]):
        problem = _refusal_problem(exc, reason)
        if problem is None:
            return
        problems.append(problem)
    raise AssertionError(f"rank {world.rank}: not the refusal expected: {'; '.join(problems)}\n"
                         f"got {type(exc).__name__}: {exc}\nconfig: {cfg}")


def _refusal_problem(exc, reason):
    names = {c.__name__ for c in type(exc).__mro__}
    if not names & {reason["error"], "CollectiveRefusedError", "ModelMismatchError"}:
        return f"expected {reason['error']}"
    text = str(exc)
    for number in reason.get("numbers", []):
        if not re.search(rf"(?<![0-9.]){number}(?![0-9.])", text):
            return f"{reason['error']} should name {number}"
    for name in reason.get("names", []):
        if name not in text:
            return f"{reason['error']} should name {name}"
    return None


def _pipeline_tie_across_ranks(cfg):
    """A Linear tied to one in a stage held by another rank (ties within a rank's stages are plain sharing)."""
    if cfg["strategy"] != "pipeline" or not has_tie(cfg["model"]):
        return False
    layers, bounds = cfg["model"]["layers"], cfg["pipeline"]["bounds"]
    p = cfg["world"] // cfg["pipeline"]["dp"]
    stage = lambda k: max(i for i in range(len(bounds) - 1) if bounds[i] <= k)  # noqa: E731
    k = next(i for i, layer in enumerate(layers) if layer[0] == "tie")
    return stage(k) % p != stage(layers[k][1]) % p


# Library bugs this generator finds, by the configurations they show in: a failure of a configuration that
# matches one is reported as an expected failure naming the bug (AXONHPC_FUZZ_STRICT=1 makes it a failure).
# Remove an entry when its bug is fixed.
# Library bugs this generator found, as (description, the configurations they show in); a failure one explains is
# an expected failure (AXONHPC_FUZZ_STRICT=1: a failure). The four it found first are fixed (2026-11-28): DDP
# NO_SYNC's sync_gradients() and unused parameters, a pipeline's accumulated tied gradients, FSDP's tie between a
# unit and the root unit (now refused), and Pipeline.clip_grad_norm over TensorParallelAttention.
KNOWN_BUGS = []


def known_bug(cfg):
    """The description of the known bug ``cfg`` may show, or None."""
    for text, applies in KNOWN_BUGS:
        if applies(cfg):
            return text
    return None


def _make_case(strategy, seed):
    def case(world):
        run_config(world, fuzz_config(strategy, seed, world.world_size))
    case.__name__ = f"case_{strategy}_{seed}"
    case.strategy, case.seed = strategy, seed
    return case


CASES = {f"case_{strategy}_{seed}": _make_case(strategy, seed)
         for strategy in STRATEGIES for seed in seeds_from_env()}


def known_bug_of_case(name, world_size):
    """The known bug case ``name`` may show at this world size, or None (always None under AXONHPC_FUZZ_STRICT)."""
    if os.environ.get("AXONHPC_FUZZ_STRICT"):
        return None
    case = CASES[name]
    return known_bug(fuzz_config(case.strategy, case.seed, world_size))
