"""What a plan reports: per category, the bytes measured on the sharded model, the closed form,
and the padding allowed between them (:class:`Bytes`); :class:`Plan` holds them and prints them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fsdp.group.policy import STRATEGIES
from tools.tp_plan import MeshShape

GiB = 2**30
MiB = 2**20

# A moment of the schedule: (whether the root holds its buffer, how many other units hold theirs).
Moment = tuple[bool, int]


@dataclass(frozen=True)
class Bytes:
    """One category on this rank: measured, closed form, and the padding that may separate them."""

    measured: int
    closed: int
    allowance: int

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.closed) <= self.allowance

    def __add__(self, other: "Bytes") -> "Bytes":
        return Bytes(self.measured + other.measured, self.closed + other.closed, self.allowance + other.allowance)


CATEGORIES = (
    ("main_weights", "main weights"),
    ("model_weights", "model weights"),
    ("unsharded_weights", "unsharded weights"),
    ("main_grads", "main grads"),
    ("grad_copies", "grad copies (.grad)"),
    ("optimizer_state", "optimizer state"),
    ("unsharded_working_set", "unsharded working set"),
    ("reduce_working_set", "reduce working set"),
)
PERSISTENT = ("main_weights", "model_weights", "unsharded_weights", "main_grads", "grad_copies", "optimizer_state")


@dataclass
class Plan:
    """Per-rank bytes of one ``fully_shard`` configuration (see the module docstring)."""

    model: str
    world: int
    rank: int
    strategy: str
    dtypes: str  # e.g. "main fp32, model bf16, main grads fp32, reduce bf16"
    optimizer: str  # "adamw", ... with " (flat)" for fsdp.optim's flat optimizers
    params: int  # parameter elements (tied ones once)
    units: int
    layout_padding: int  # elements of all units' layouts that hold no tensor
    main_weights: Bytes
    model_weights: Bytes
    unsharded_weights: Bytes
    main_grads: Bytes
    grad_copies: Bytes
    optimizer_state: Bytes
    unsharded_working_set: Bytes
    reduce_working_set: Bytes
    padding: int  # bytes of this rank's persistent buffers holding no tensor element
    padding_mean: int  # the same, averaged over the ranks
    device: str  # where the shards were built: "meta" (nothing allocated) or a real device
    released_between_uses: bool  # every working-set buffer held no storage after fully_shard
    peak_moments: dict[str, Moment]  # per working set: the moment of its peak (root held, other units)
    seconds: dict[str, float] = field(default_factory=dict)
    grad_copy_bytes: int = 0  # closed form of the FP32 .grad copies, whether made or not (flat)
    mesh: dict[str, int] = field(default_factory=dict)  # {"dp_replicate": R, "dp_shard": S, "tp": T}
    local_params: int = 0  # parameter elements on this rank's TP piece (= params without TP)
    outer_dp_sharding_strategy: str = "no_shard"  # "optim": HFSDP (fsdp.compose.outer_shard)
    layouts: dict[str, int] = field(default_factory=dict)  # groups per layout kind: {"ragged": 80, ...}
    layout_policy: str = "chunk"  # fsdp.group.layout_choice's kind the groups were built under

    def categories(self) -> dict[str, Bytes]:
        return {key: getattr(self, key) for key, _ in CATEGORIES}

    @property
    def persistent(self) -> Bytes:
        return sum((getattr(self, k) for k in PERSISTENT), Bytes(0, 0, 0))

    @property
    def total(self) -> Bytes:
        return sum(self.categories().values(), Bytes(0, 0, 0))

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.categories().values()) and self.total.ok

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total"] = dataclasses.asdict(self.total)
        out["ok"] = self.ok
        return out

    def format(self) -> str:
        shape = MeshShape(**self.mesh) if self.mesh else MeshShape(1, self.world, 1)
        mesh = "" if shape.is_1d else f" = {shape.describe()}"
        if self.outer_dp_sharding_strategy == "optim":
            mesh += " (HFSDP: optimizer sharded over dp_replicate x dp_shard)"
        tp = "" if shape.tp == 1 else f" ({self.local_params:,} on this TP rank, Llama TP plan)"
        head = (
            f"{self.model}: {self.params:,} parameters{tp} in {self.units} units, world {self.world}{mesh}, rank {self.rank}, "
            f"{self.strategy} (ZeRO-{list(STRATEGIES).index(self.strategy)}), {self.dtypes}, {self.optimizer}"
            + ("" if self.device == "meta" else f", shards on {self.device}")
        )
        rows = [head, f"{'category':<24}{'GiB/rank':>11}{'closed GiB':>12}{'diff':>11}{'allowance':>12}  check"]
        for key, label in CATEGORIES:
            rows.append(_row(label, getattr(self, key)))
        rows.append(_row("total", self.total))
        share = self.layout_padding / max(1, (self.local_params or self.params) + self.layout_padding)
        rows.append(
            f"{'of which padding':<24}{self.padding / GiB:>11.4f}  on this rank; {self.padding_mean / GiB:.4f} GiB "
            f"on average (the layouts pad {100 * share:.4f}%)"
        )
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.layouts.items()))
        rows.append(f"layouts ({self.layout_policy}): {kinds} group(s)")
        for key, (root, k) in self.peak_moments.items():
            held = ("the root" if root else "") + (" + " if root and k else "") + (f"{k} other unit(s)" if k else "")
            rows.append(f"{key.replace('_', ' ')}: peak while {held or 'nothing'} held it (schedule of the probe)")
        rows.extend(self.trade_offs())
        verdict = "measured = closed form within padding" if self.ok else "MISMATCH beyond padding"
        times = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        rows.append(f"{verdict}; {times}")
        return "\n".join(rows)


    def trade_offs(self) -> list[str]:
        """The memory knobs that apply to this configuration and what each costs or saves."""
        rows = []
        if self.grad_copy_bytes:
            size = f"{self.grad_copy_bytes / GiB:.4f} GiB/rank"
            if self.optimizer.endswith("(flat)"):
                rows.append(f"grad copies: none, the flat optimizer upcasts by chunks (torch.optim would cast {size})")
            else:
                rows.append(f"grad copies: torch.optim needs FP32 .grad ({size}); fsdp.FlatAdamW (--flat-optimizer) saves it")
        return rows


def _row(label: str, b: Bytes) -> str:
    diff = b.measured - b.closed
    rel = f"{100 * diff / b.closed:+.4f}%" if b.closed else ("0" if not diff else "inf")
    return (
        f"{label:<24}{b.measured / GiB:>11.4f}{b.closed / GiB:>12.4f}{rel:>11}"
        f"{b.allowance / MiB:>9.2f} MiB  {'ok' if b.ok else 'FAIL'}"
    )
