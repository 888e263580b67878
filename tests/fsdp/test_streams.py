"""fsdp/group/streams.py: one set of comm streams per device through torch's device module, and the
ordering protocol of its docstring, step by step, on a device module that records every call
(the development machine has no GPU; on the CPU the same lines run on torch.cpu's stand-ins)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from fsdp.group import streams as streams_module
from fsdp.group.streams import CommStreams


def test_cpu_and_meta_get_torch_cpu_stand_ins_shared_by_every_user() -> None:
    cpu = CommStreams.for_device(torch.device("cpu"))
    assert cpu is CommStreams.for_device(torch.device("cpu")) and copy.deepcopy(cpu) is cpu
    assert cpu.module is torch.cpu and not cpu.enabled
    assert isinstance(cpu.all_gather, torch.cpu.Stream) and cpu.all_gather is not cpu.reduce_scatter
    meta = CommStreams(torch.device("meta"))  # no torch.meta module: the stand-ins too
    assert meta.module is torch.cpu and not meta.enabled


def test_a_cpu_launch_runs_on_the_side_stream_and_restores_the_current_one() -> None:
    s = CommStreams(torch.device("cpu"))
    before = torch.cpu.current_stream()
    with s.launch(s.reduce_scatter):
        assert torch.cpu.current_stream() is s.reduce_scatter
    assert torch.cpu.current_stream() is before
    with pytest.raises(ValueError), s.launch(s.all_gather):
        raise ValueError("a failed launch")
    assert torch.cpu.current_stream() is before
    # a failed launch ends no launch (nothing for wait() to wait on) and leaves no open frame
    assert id(s.all_gather) not in s._last_launch and id(s.reduce_scatter) in s._last_launch
    assert s._frames() == []
    s.wait(s.reduce_scatter)  # stand-in events: nothing to wait for, and no error


class _Log:
    def __init__(self) -> None:
        self.calls: list[tuple] = []


class _FakeEvent:
    count = 0

    def __init__(self, log: _Log) -> None:
        _FakeEvent.count += 1
        self.name, self.log = f"e{_FakeEvent.count}", log

    def record(self, stream) -> None:
        self.log.calls.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.calls.append(("host waits", self.name))


class _FakeStream:
    def __init__(self, name: str, log: _Log) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.calls.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.calls.append(("wait_event", self.name, event.name))


class _FakeModule:
    """A device module with real-looking streams whose every ordering call is logged."""

    def __init__(self) -> None:
        self.log = _Log()
        self.compute = _FakeStream("compute", self.log)
        self.current = self.compute
        self.made = 0

    def Stream(self, priority: int = 0, device=None) -> _FakeStream:  # noqa: N802 (torch's name)
        self.made += 1
        return _FakeStream(("all_gather", "reduce_scatter")[self.made - 1], self.log)

    def Event(self) -> _FakeEvent:  # noqa: N802
        return _FakeEvent(self.log)

    def current_stream(self, device=None) -> _FakeStream:
        return self.current

    def stream(self, stream):
        module = self

        class _Context:
            def __enter__(self):
                self.prev, module.current = module.current, stream

            def __exit__(self, *exc):
                module.current = self.prev

        return _Context()


@pytest.fixture
def fake(monkeypatch) -> tuple[CommStreams, _FakeModule]:
    module = _FakeModule()
    monkeypatch.setattr(streams_module, "_device_module", lambda device: module)
    return CommStreams(torch.device("cuda", 0)), module


def test_gather_then_copy_out_then_the_next_gather(fake) -> None:
    s, dev = fake
    assert s.enabled
    with s.launch(s.all_gather):  # 1. after the compute stream's work; an event ends the launch
        assert dev.current is s.all_gather
        dev.log.calls.append(("collective", "all_gather"))
    assert dev.current is dev.compute
    s.wait(s.all_gather)  # 2. compute waits for that event, then copies out
    dev.log.calls.append(("copy-out", "compute"))
    with s.launch(s.all_gather):  # the next gather is ordered after the copy-out
        pass
    calls = dev.log.calls
    ended = calls[2][1]  # the event that ended the first launch
    assert calls[:6] == [
        ("wait_stream", "all_gather", "compute"),
        ("collective", "all_gather"),
        ("record", ended, "all_gather"),
        ("wait_event", "compute", ended),
        ("copy-out", "compute"),
        ("wait_stream", "all_gather", "compute"),
    ], calls
    assert len(calls) == 7 and calls[6][0] == "record" and calls[6][2] == "all_gather", calls


def test_reads_across_streams_are_ordered_by_events_not_record_stream(fake) -> None:
    s, dev = fake
    # 5a. a side-stream allocation read on the compute stream: both side streams' next launches wait
    read = s.record()
    s.after_read(read)
    with s.launch(s.reduce_scatter):
        pass
    with s.launch(s.reduce_scatter):  # waited for once
        pass
    assert ("wait_event", "reduce_scatter", read.name) in dev.log.calls
    assert dev.log.calls.count(("wait_event", "reduce_scatter", read.name)) == 1
    dev.log.calls.clear()
    with s.launch(s.all_gather):
        pass
    assert ("wait_event", "all_gather", read.name) in dev.log.calls
    # 5b. compute memory read inside a launch: the compute stream waits when the launch ends
    dev.log.calls.clear()
    with s.launch(s.reduce_scatter):
        done = s.record()  # e.g. an offload download, recorded on the side stream
        s.launcher_waits(done)
        assert ("wait_event", "compute", done.name) not in dev.log.calls
    assert dev.log.calls[-1] == ("wait_event", "compute", done.name)
    assert ("record", done.name, "reduce_scatter") in dev.log.calls


def test_post_optim_event_waited_by_the_gather_stream_or_the_host(fake) -> None:
    s, dev = fake
    event = _FakeEvent(dev.log)
    s.gathers_wait(event)
    assert dev.log.calls == [("wait_event", "all_gather", event.name)]
    s.enabled = False  # as on the CPU: no real streams, the host waits
    s.gathers_wait(event)
    assert dev.log.calls[-1] == ("host waits", event.name)


def test_a_launch_hands_back_only_what_its_own_thread_queued(fake) -> None:
    s, dev = fake
    with s.launch(s.reduce_scatter):
        mine = s.record()
        s.launcher_waits(mine)
        theirs = s.record()
        # another thread (a threaded rank) with no launch open: its current stream waits at once
        t = threading.Thread(target=s.launcher_waits, args=(theirs,))
        t.start()
        t.join()
    waits = [c for c in dev.log.calls if c[0] == "wait_event"]
    assert waits == [("wait_event", "reduce_scatter", theirs.name), ("wait_event", "compute", mine.name)], waits


@pytest.fixture
def fake_everywhere(monkeypatch) -> _FakeModule:
    """Every device's streams on the logging module, in a cache of this test's own."""
    module = _FakeModule()
    monkeypatch.setattr(streams_module, "_device_module", lambda device: module)
    monkeypatch.setattr(streams_module, "_CACHE", {})
    return module


def test_offload_download_and_custom_comm_staging_use_events(fake_everywhere) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp.compose.custom_comm import _keep_until_used
    from fsdp.compose.offload import HostOffload
    from tests.models.device_standins import deferred_transfers

    dev = fake_everywhere
    device = torch.device("meta")  # stands for an accelerator: its streams are the logging module's
    s = CommStreams.for_device(device)
    with deferred_transfers():  # pinned host memory and non-blocking copies, on the CPU
        host = HostOffload(CPUOffloadPolicy(pin_memory=True), device)
    assert host.pin
    grad_in, main_grad = torch.ones(4), host.transfers.host_tensor(4, torch.float32, zero=True)
    with s.launch(s.reduce_scatter):  # finish_reduce's download of a reduction's result
        host.download(grad_in, main_grad, add=False)
    copied = dev.log.calls[1]  # after the launch's wait for the compute stream
    assert copied[0] == "record" and copied[2] == "reduce_scatter", dev.log.calls
    # the compute stream waits for the copy before it can reuse grad_in's memory ...
    assert dev.log.calls[-1] == ("wait_event", "compute", copied[1]), dev.log.calls
    assert main_grad.isnan().all()  # not landed: the host must wait for it ...
    host.settle()  # ... and does, before it touches the host buffer
    assert dev.log.calls[-1] == ("host waits", copied[1]) and torch.equal(main_grad, grad_in)
    # a comm object's staging buffer read by the copy-out on the compute stream
    dev.log.calls.clear()
    _keep_until_used(torch.empty(4, device=device))
    read = dev.log.calls[-1]
    assert read[0] == "record" and read[2] == "compute", dev.log.calls
    for side in (s.all_gather, s.reduce_scatter):
        with s.launch(side):
            pass
        assert ("wait_event", side.name, read[1]) in dev.log.calls


def test_offload_without_pinned_memory_records_nothing(fake_everywhere) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp.compose.offload import HostOffload

    host = HostOffload(CPUOffloadPolicy(pin_memory=True), torch.device("cpu"))  # nothing to pin for
    assert not host.pin
    dst = torch.zeros(4)
    host.download(torch.ones(4), dst, add=False)  # a synchronous copy: done on return
    assert torch.equal(dst, torch.ones(4))
    host.settle()
    assert fake_everywhere.log.calls == []


def test_an_all_reduce_hook_on_its_own_stream_is_ordered_both_ways(fake) -> None:
    from fsdp.group.reduction import ReduceSettings

    s, dev = fake
    hook_stream = _FakeStream("hook", dev.log)
    ran_on = []
    settings = ReduceSettings(hook=lambda t: ran_on.append(dev.current.name) or t.mul_(2), hook_stream=hook_stream)
    reduced = torch.ones(3)
    for step in settings.finishing(mesh=None, streams=s):
        step(reduced)
    assert ran_on == ["hook"] and torch.equal(reduced, torch.full((3,), 2.0))
    assert dev.log.calls == [("wait_stream", "hook", "compute"), ("wait_stream", "compute", "hook")], dev.log.calls
    assert dev.current is dev.compute


def test_reduction_finishing_steps_are_decided_once_from_the_settings() -> None:
    """A reduction's finish runs the steps its settings compiled: none by default (an averaging
    collective needs nothing after it), a division by the factor (before the hook, or after it
    when sums are forced, by the mesh size without a factor), and no division by 1."""
    import types

    from fsdp.group.reduction import ReduceSettings

    mesh = types.SimpleNamespace(size=lambda: 8)
    seen = []

    def finished(settings: ReduceSettings) -> torch.Tensor:
        reduced = torch.full((3,), 24.0)
        for step in settings.finishing(mesh, streams=None):
            step(reduced)
        return reduced

    assert ReduceSettings().finishing(mesh, streams=None) == ()
    assert torch.equal(finished(ReduceSettings(divide_factor=4.0)), torch.full((3,), 6.0))
    assert torch.equal(finished(ReduceSettings(force_sum=True)), torch.full((3,), 3.0))
    assert ReduceSettings(force_sum=True, divide_factor=1.0).finishing(mesh, streams=None) == ()
    hooked = ReduceSettings(force_sum=True, divide_factor=2.0, hook=lambda t: seen.append(t.clone()))
    assert torch.equal(finished(hooked), torch.full((3,), 12.0))
    assert torch.equal(seen[0], torch.full((3,), 24.0))  # forced sums: the hook sees them undivided


# ----------------------------------------------------------------------------- the protocol in fsdp's waits


class _Logged:
    """A collective's handle whose ``wait`` is logged (a custom comm copies its output there)."""

    def __init__(self, pending, log: list) -> None:
        self.pending, self.log = pending, log

    def wait(self):
        self.log.append("handle")
        return self.pending.wait()


def _waits_in_order() -> dict:
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp

    mesh = init_device_mesh("cpu", (1,))
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fsdp.fully_shard(m[0], mesh=mesh)
    fsdp.fully_shard(m, mesh=mesh)
    block = m[0]._fsdp_state
    group = block.groups[0]
    streams, log = group.streams, []
    streams.wait = lambda stream: log.append("gather stream" if stream is streams.all_gather else "reduce stream")
    out = {}
    try:
        # a gather: the compute stream waits for the launch's event before the handle's copy-out
        block.unshard(async_op=True)
        group.unsharder._pending = _Logged(group.unsharder._pending, log)
        block.wait_unshard()
        out["gather"], log[:] = list(log), []
        block.reshard()
        # accumulating backwards: the reductions stay in flight, folded on the reduce-scatter stream
        m.set_is_last_backward(False)
        for _ in range(2):
            m(torch.randn(4, 8)).sum().backward()
        out["folded"] = group.grads._in_flight is not None and group.grads._in_flight.folded
        flight = group.grads._in_flight
        flight.pending = _Logged(flight.pending, log)
        log[:] = []
        group.grads.finish_reduce()
        out["finish"], log[:] = list(log), []
        m(torch.randn(4, 8)).sum().backward()  # in flight again, then zeroed by the user
        log[:] = []
        m.zero_grad_buffer()
        out["zero"] = list(log)
    finally:
        del streams.wait
    return out


def test_fsdp_waits_for_a_launch_event_before_the_handle_and_before_zeroing() -> None:
    """On a GPU the order matters (on the CPU the same lines run): the compute stream waits for a
    launch's event before a handle's ``wait`` copies its output (a custom comm; one that returned
    no work is ordered by the event alone), and ``zero_grad_buffer`` waits for the reduce-scatter
    stream, where a folded reduction still adds into ``main_grad``, before zeroing it."""
    from tests.harness import run_ranks

    (out,) = run_ranks(_waits_in_order, 1, backend="threaded")
    assert out["gather"] == ["gather stream", "handle"], out
    assert out["folded"], out
    assert out["finish"] == ["reduce stream", "handle"], out
    assert out["zero"] and set(out["zero"]) == {"reduce stream"}, out  # one wait per reducer in flight
