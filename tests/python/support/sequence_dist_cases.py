"""Body of tests/python/test_reliability_sequences_distributed.py, run on both
ranks of one spawned gloo world (W = 2): seeded random sequences of API calls
on an optimizer over DTensor params (Shard(0) and Replicate) and plain params,
including calls that fail on ONE rank only. Both ranks draw the same sequence
(one `random.Random(seed)` each, same seed). After every call:

  * calls that are collectives (step, load_state_dict, update_param of a
    DTensor param, add_param_group with DTensor params): every rank has the
    same outcome (completed, completed then ParamWriterError, or raised);
  * it raised: this rank's snapshot (params, state, groups, writers, modes;
    DTensors by their local parts) is bit for bit what it was;
  * it completed: the same call on a single-process reference (plain params
    of the same full values, FP32 masters, writers that never fail) completes
    too, and every FP32 master, param and state tensor, gathered in full,
    equals the reference's bit for bit.

Calls on plain params alone (update_param, register / unregister) are
rank-local by design (docs/design.md, "Every call completes or changes
nothing": plain params run no collectives), so their one-rank failures are
checked per rank only."""

from __future__ import annotations

import copy
import json
import random
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from muon_ext import MuonAdamW
from muon_ext.writers import ParamWriterError
from support.distributed_cases import dtensor
from support.optimizer_snapshot import snapshot

# (param dtype, optimizer options); the reference keeps FP32 masters (the path every mode is bit-identical to).
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16_remainder": (torch.bfloat16, {}),
    "bf16_fp32_master": (torch.bfloat16, {"store_param_remainders": False}),
}
# (shape, placements or None for a plain param, group index)
PARAMS = [((8, 6), [Shard(0)], 0), ((5, 4), [Shard(0)], 0), ((4, 4), None, 0),
          ((4, 4), [Replicate()], 1), ((6,), [Shard(0)], 2), ((5,), None, 2)]
GROUPS = [{"kind": "muon", "lr": 0.02}, {"kind": "muon", "lr": 0.03, "beta2": None}, {"kind": "adamw", "lr": 0.01}]
PLAIN = [i for i, (_, placements, _) in enumerate(PARAMS) if placements is None]
COMPLETED, WRITER_ERROR, RAISED = 0, 1, 2


def _values(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class FlakyWriter:
    """Fails on the ranks in `fail_ranks` (a failing inference engine on those ranks only)."""

    def __init__(self, rank: int, fail_ranks):
        self.rank, self.fail_ranks = rank, set(fail_ranks)

    def __call__(self, param, master, stream, found_inf):
        if self.rank in self.fail_ranks:
            raise RuntimeError(f"engine down on rank {self.rank}")


class Twin:
    """The optimizer under test (DTensor and plain params) and its single-process reference."""

    def __init__(self, config: str, rank: int, mesh, stats: Dict[str, int]):
        self.rank, self.mesh, self.stats = rank, mesh, stats
        self.dtype, options = CONFIGS[config]
        self.placements = [pl for _, pl, _ in PARAMS]
        full = [_values(shape, i).to(self.dtype) for i, (shape, _, _) in enumerate(PARAMS)]
        self.params = [torch.nn.Parameter(self._dist(v, pl)) for v, pl in zip(full, self.placements)]
        self.ref_params = [torch.nn.Parameter(v.clone()) for v in full]
        self.opt = MuonAdamW(self._groups(self.params), adapters=False, **options)
        self.ref = MuonAdamW(self._groups(self.ref_params), adapters=False, store_param_remainders=False)
        self.writers: Dict[int, FlakyWriter] = {}
        self.saved = None
        self.added = 0

    def _dist(self, full: torch.Tensor, placements):
        return full.clone() if placements is None else dtensor(full, self.mesh, placements)

    @staticmethod
    def _groups(params):
        return [dict(GROUPS[g], params=[p for p, (_, _, gi) in zip(params, PARAMS) if gi == g])
                for g in range(len(GROUPS))]

    # -- checks -------------------------------------------------------------

    def compare(self) -> None:
        """Every master, param and state tensor equal to the reference's, bit for bit (DTensors gathered: a
        collective, in the same order on every rank; plain params that are non-contiguous on this rank are
        compared once contiguous again, as their masters cannot be read now)."""
        for i, (p, r, pl) in enumerate(zip(self.params, self.ref_params, self.placements)):
            if pl is None and not p.is_contiguous():
                continue
            mine = self.opt.gather_full_parameter_master(p) if pl is not None else self.opt.get_full_parameter_master(p)
            _same(mine, self.ref.get_full_parameter_master(r), f"master of param {i}")
            if self.opt._states.info(p).master_mode != "remainder":  # remainder mode rounds ties up (split rule)
                _same(p.full_tensor() if pl is not None else p.detach(), r.detach(), f"param {i}")
            for key in sorted(self.ref.state[r]):
                if key == "master_param":
                    continue
                got = self.opt.state[p].get(key)
                assert got is not None, f"param {i} lacks '{key}'"
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                _same(torch.as_tensor(got).float(), torch.as_tensor(self.ref.state[r][key]).float(),
                      f"param {i} '{key}'")

    def apply(self, name: str, mine: Callable, theirs: Callable, collective: bool) -> int:
        """Runs `mine`; checks the rule (and, for a collective call, that every rank had the same outcome);
        mirrors a completed call on the reference with `theirs`; compares (a rank-local call may complete on
        one rank and raise on another). Returns the outcome."""
        before = snapshot(self.opt)
        self.stats["calls"] += 1
        self.stats[f"calls.{name}"] = self.stats.get(f"calls.{name}", 0) + 1
        outcome, error = COMPLETED, None
        try:
            mine()
        except ParamWriterError:
            outcome = WRITER_ERROR  # completed, then reported
        except Exception as exc:
            outcome, error = RAISED, exc
        if collective:
            outcomes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(outcomes, torch.tensor([outcome]))
            outcomes = [int(o) for o in outcomes]
            assert len(set(outcomes)) == 1, f"{name}: outcomes differ across ranks {outcomes}: {error!r}"
        self.stats[("completed", "writer_errors", "raised")[outcome]] += 1
        if outcome == RAISED:
            self.stats[f"raised.{name}"] = self.stats.get(f"raised.{name}", 0) + 1
            assert snapshot(self.opt) == before, f"{name} raised ({error!r}) after changing the optimizer"
        else:
            theirs()
        self.compare()  # on every rank, whatever the outcome here: its gathers are collectives
        return outcome


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    kind = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(kind), b.contiguous().view(kind)), f"{what} differs from the reference"


# -- calls ------------------------------------------------------------------


def _set_grads(t: Twin, seed: int, present) -> None:
    """The same full grads on both ranks' params (split like them) and on the reference's (None where absent)."""
    for i, (p, r, pl) in enumerate(zip(t.params, t.ref_params, t.placements)):
        g = _values(r.shape, seed + i).to(t.dtype) if present[i] else None
        r.grad = g
        p.grad = None if g is None else t._dist(g, pl)


def _step(t: Twin, rnd: random.Random) -> None:
    seed = rnd.randrange(10**6)
    n = len(t.params)
    kind = rnd.choice(["all", "all", "some", "grad_on_one_rank", "odd_grad_on_one_rank", "released_on_one_rank"])
    present = [rnd.random() < 0.7 for _ in range(n)] if kind == "some" else [True] * n
    odd, odd_rank = rnd.randrange(n), rnd.randrange(2)
    _set_grads(t, seed, present)
    for i, (p, r, pl) in enumerate(zip(t.params, t.ref_params, t.placements)):
        g = r.grad
        if i != odd or t.rank != odd_rank:
            continue
        if kind == "grad_on_one_rank" and pl is not None:
            p.grad = None  # a DTensor grad on one rank only: refused on both
        elif kind == "odd_grad_on_one_rank" and g.dim() == 2:  # a transposed-layout grad on one rank only
            p.grad = t._dist(g.t().contiguous().t(), pl)
        elif kind == "released_on_one_rank":
            local = p.grad.to_local() if pl is not None else p.grad
            local.untyped_storage().resize_(0)
    t.stats[f"step.{kind}"] = t.stats.get(f"step.{kind}", 0) + 1
    t.apply("step", t.opt.step, t.ref.step, collective=True)


def _update_param(t: Twin, rnd: random.Random) -> None:
    i = rnd.randrange(len(t.params))
    pl = t.placements[i]
    kind = rnd.choice(["ok", "ok", "nan", "nan_on_one_rank", "shape_on_one_rank"])
    values = _values(t.ref_params[i].shape, rnd.randrange(10**6))
    one_rank = rnd.randrange(2)
    mine = values.clone()
    if kind == "nan" or (kind == "nan_on_one_rank" and t.rank == one_rank):
        mine.view(-1)[-1 if t.rank == 1 else 0] = float("nan")  # in this rank's part of a Shard(0) param
    if kind == "shape_on_one_rank" and t.rank == one_rank:
        mine = torch.cat([mine, mine[:1]])  # one more row
    mine = t._dist(mine, pl)
    t.apply("update_param", lambda: t.opt.update_param(t.params[i], mine),
            lambda: t.ref.update_param(t.ref_params[i], values), collective=pl is not None)


def _pick(rnd: random.Random, options: list):
    """One of `options` for one draw whatever their number (rnd.choice draws more bits for some lengths: the
    ranks' sequences would part where the options differ across ranks)."""
    return options[int(rnd.random() * len(options))]


def _fail_ranks(rnd: random.Random):
    return rnd.choice([(), (), (0,), (1,), (0, 1)])


def _register(t: Twin, rnd: random.Random) -> None:
    i = rnd.choice(PLAIN)  # writers for DTensor params are refused (tested elsewhere)
    writer = FlakyWriter(t.rank, _fail_ranks(rnd))

    def mine():
        t.opt.register_param_writer(t.params[i], writer)
        t.writers[i] = writer

    t.apply("register", mine, lambda: t.ref.register_param_writer(t.ref_params[i], FlakyWriter(t.rank, ())),
            collective=False)


def _unregister(t: Twin, rnd: random.Random) -> None:
    i = rnd.choice(PLAIN)

    def mine():
        t.opt.unregister_param_writer(t.params[i])
        del t.writers[i]

    t.apply("unregister", mine, lambda: t.ref.unregister_param_writer(t.ref_params[i]), collective=False)


def _fix_writers(t: Twin, rnd: random.Random) -> None:
    for i in PLAIN:  # a draw per plain param, writer or not: the ranks' writers may differ (rank-local calls)
        fail_ranks = set(_fail_ranks(rnd))
        if i in t.writers:
            t.writers[i].fail_ranks = fail_ranks


def _save_and_load(t: Twin, rnd: random.Random) -> None:
    kind = rnd.choice(["own", "saved", "corrupt", "corrupt_on_one_rank"])
    if kind == "own" or t.saved is None:
        # state_dict() reads every master: refused where a plain param is non-contiguous on this rank only.
        # It is rank-local; the load that follows is a collective, so the ranks first agree it can start.
        saved_here: list = []
        t.apply("state_dict", lambda: saved_here.append(copy.deepcopy(t.opt.state_dict())), lambda: None,
                collective=False)
        everywhere = torch.tensor([int(bool(saved_here))])
        dist.all_reduce(everywhere)
        if int(everywhere) < dist.get_world_size():
            return
        saved = (saved_here[0], copy.deepcopy(t.ref.state_dict()))

        def mine():
            t.opt.load_state_dict(saved[0])
            t.saved = saved

        t.apply("load_state_dict", mine, lambda: t.ref.load_state_dict(saved[1]), collective=True)
        return
    sd, ref_sd = copy.deepcopy(t.saved[0]), copy.deepcopy(t.saved[1])
    if len(sd["param_groups"]) != len(t.opt.param_groups):
        return  # saved before add_param_group: refused by the count check on both ranks, tested elsewhere
    index = _pick(rnd, sorted(sd["state"]))
    key = _pick(rnd, sorted(sd["state"][index]))  # a plain param's keys may differ across ranks (its writer)
    if kind == "corrupt" or (kind == "corrupt_on_one_rank" and t.rank == rnd.randrange(2)):
        sd["state"][index][key] = torch.zeros(7, 7) if key != "step" else -1.0
    t.apply("load_state_dict", lambda: t.opt.load_state_dict(sd), lambda: t.ref.load_state_dict(ref_sd),
            collective=True)


def _add_group(t: Twin, rnd: random.Random) -> None:
    kind = rnd.choice(["ok", "lr_on_one_rank", "ns_steps_differ", "duplicate"])
    one_rank = rnd.randrange(2)
    if kind == "duplicate" or t.added >= 2:  # a DTensor param the optimizer already has: refused on both
        t.apply("add_param_group", lambda: t.opt.add_param_group({"params": [t.params[0]], "kind": "muon"}),
                lambda: None, collective=True)
        return
    full = _values((3, 5), 1000 + t.added).to(t.dtype)
    p, r = torch.nn.Parameter(t._dist(full, [Shard(0)])), torch.nn.Parameter(full.clone())
    group = {"params": [p], "kind": "muon", "lr": 0.05}
    if kind == "lr_on_one_rank" and t.rank == one_rank:
        group["lr"] = -1.0
    if kind == "ns_steps_differ":
        group["ns_steps"] = 3 + 2 * t.rank

    def mine():
        t.opt.add_param_group(group)
        t.params.append(p)
        t.placements.append([Shard(0)])
        t.added += 1

    def theirs():
        t.ref.add_param_group({"params": [r], "kind": "muon", "lr": 0.05})
        t.ref_params.append(r)

    t.apply("add_param_group", mine, theirs, collective=True)


# What a scheduler or a user edits between steps, per group kind: (key, new value).
SETTING_EDITS = {
    "muon": [("lr", 0.05), ("weight_decay", 0.0), ("momentum", 0.9), ("nesterov", False), ("beta2", 0.9),
             ("ns_steps", 3), ("lr_scale", "match_rms_adamw"), ("polar_dtype", "float32")],
    "adamw": [("lr", 0.02), ("weight_decay", 0.0), ("betas", (0.8, 0.99)), ("eps", 1e-6),
              ("bias_correction", False)],
}


def _edit_settings(t: Twin, rnd: random.Random) -> None:
    """A group setting edited between steps: on both ranks (mirrored on the reference; later steps use it), or
    on one rank only (a scheduler stepped there alone): then a step with grads everywhere must be refused on
    every rank with nothing changed (the step's settings digest), and the edit is undone on that rank."""
    g = rnd.randrange(len(GROUPS))
    edits = SETTING_EDITS[t.opt.param_groups[g]["kind"]]
    lr_first = rnd.random() < 0.4  # the lr (what schedulers edit) more often than the rest
    key, value = _pick(rnd, edits)
    key, value = edits[0] if lr_first else (key, value)
    one_rank = rnd.choice([None, 0, 1])
    seed = rnd.randrange(10**6)
    group = t.opt.param_groups[g]
    if one_rank is None:
        group[key] = t.ref.param_groups[g][key] = value
        t.stats["edit.both"] = t.stats.get("edit.both", 0) + 1
        return
    old = group[key]
    if t.rank == one_rank:
        group[key] = value
    _set_grads(t, seed, [True] * len(t.params))
    outcome = t.apply("step", t.opt.step, t.ref.step, collective=True)
    assert outcome == RAISED or old == value, f"'{key}' edited on rank {one_rank} only, and the step completed"
    group[key] = old
    t.stats[f"edit.one_rank.{key}"] = t.stats.get(f"edit.one_rank.{key}", 0) + 1


def _layout_change(t: Twin, rnd: random.Random) -> None:
    """Between calls, as a model conversion would, on one rank or both: a plain param's data becomes
    non-contiguous (values kept), or contiguous again. No call is made."""
    i = rnd.choice([k for k in PLAIN if len(PARAMS[k][0]) == 2])
    ranks = rnd.choice([(0,), (1,), (0, 1)])
    if t.rank not in ranks:
        return
    p = t.params[i]
    p.data = p.data.t().contiguous().t() if p.is_contiguous() else p.data.contiguous()


RULES = [_step, _step, _step, _update_param, _update_param, _register, _unregister, _fix_writers,
         _save_and_load, _add_group, _layout_change, _edit_settings]


def run_sequences(rank: int, world: int, first_seed: int, sequences: int, calls: int, stats_path: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    stats: Dict[str, int] = {"sequences": 0, "calls": 0, "completed": 0, "writer_errors": 0, "raised": 0}
    configs: List[str] = sorted(CONFIGS)
    for s in range(sequences):
        seed = first_seed + s
        rnd = random.Random(seed)  # the same draws on every rank
        config = configs[rnd.randrange(len(configs))]
        twin = Twin(config, rank, mesh, stats)
        stats["sequences"] += 1
        for k in range(rnd.randint(1, calls)):
            rule = rnd.choice(RULES)
            try:
                rule(twin, rnd)
            except BaseException as exc:
                raise AssertionError(f"rank {rank}: sequence seed {seed} ({config}), call {k} ({rule.__name__}): "
                                     f"{exc}") from exc
        dist.barrier()
    if rank == 0:
        with open(stats_path, "w") as f:
            json.dump(stats, f)
