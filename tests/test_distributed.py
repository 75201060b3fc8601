"""Stages on other processes: a program split over ranks, two processes over Gloo on the
loopback address with emulated devices (CPU), and NCCL on two GPUs (marker cuda)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ferry
from ferry.program.ranks import RECV, SEND, boundaries, program_ranks, project
from ferry.program.schema import DelegateCall, KernelCall

WORKER = Path(__file__).with_name("distributed_worker.py")
SRC = Path(__file__).parents[1] / "src"


class Stages(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.b = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 8))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def split_program(batch: int = 4, second: str = "rank1:emu:0", first: str = "emu:0"):
    ep = torch.export.export(Stages().eval(), (torch.randn(batch, 16),))
    return ferry.compile(ep, ferry.DeviceMapPartitioner({"a": first, "b": second}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, program, calls, options=None, world: int = 2, limit: float = 120) -> list[dict]:
    """Run the worker on `world` processes; each returns its report (rank 0: the outputs)."""
    path, inputs = tmp_path / "split.ferry", tmp_path / "inputs.pt"
    program.save(path)
    torch.save(calls, inputs)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(path), str(inputs),
                                       str(tmp_path / f"rank{rank}.pt"), json.dumps(options or {})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=limit)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [q.communicate()[0].decode(errors="replace")[-4000:] for q in procs]
            pytest.fail(f"a rank did not finish within {limit} s: the job hung\n" +
                        "\n".join(f"--- rank {r}:\n{t}" for r, t in enumerate(tails)))
    reports = []
    for rank in range(world):
        f = tmp_path / f"rank{rank}.pt"
        report = torch.load(f, weights_only=False) if f.exists() else {"rank": rank, "log": logs[rank]}
        reports.append({**report, "exit": procs[rank].returncode})
    return reports


# ---- compile and projection (one process)


def test_a_device_map_may_name_ranks_and_the_report_shows_copies_between_them(emu):
    program = split_program()
    assert program_ranks(program) == (0, 1)
    rows = program.copy_report()["forward"].rows
    crossing = [r for r in rows if "rank1" in r.src or "rank1" in r.dst]
    assert [(r.direction, r.src, r.dst) for r in crossing] == [("d2d", "emu:0", "rank1:emu:0"),
                                                              ("d2h", "rank1:emu:0", "cpu:0")]
    assert [b.nbytes for b in boundaries(program)] == [r.nbytes for r in crossing]
    again = ferry.load_program(program.to_bytes())  # the file keeps the ranks
    assert program_ranks(again) == (0, 1)


def test_each_rank_keeps_only_its_part(emu):
    program = split_program()
    m = program.method("forward")
    zero, one = project(program, 0).method("forward"), project(program, 1).method("forward")
    kinds = lambda meth: [i.kernel if isinstance(i, KernelCall) else "delegate" for i in meth.instructions]  # noqa: E731
    assert kinds(zero).count(SEND) == 1 and kinds(zero).count(RECV) == 1
    assert kinds(one) == [RECV, "delegate", SEND]
    own = lambda meth: {i.delegate for i in meth.instructions if isinstance(i, DelegateCall)}  # noqa: E731
    assert own(zero).isdisjoint(own(one)) and len(own(zero) | own(one)) == 2
    # memory of the other rank is never allocated; this rank's devices are local
    assert sum(b.size for b in one.buffers if b.device.type == "cpu") == 0
    assert all(b.device.rank == 0 for b in one.buffers) and sum(b.size for b in one.buffers) > 0
    assert sum(b.size for b in zero.buffers) + sum(b.size for b in one.buffers) == sum(b.size for b in m.buffers)
    # rank 0's receive of the output is waited for at the end of the call (nothing reads it)
    recv = next(i for i in zero.instructions if isinstance(i, KernelCall) and i.kernel == RECV)
    assert zero.values[recv.args[4]].value is True
    recv1 = next(i for i in one.instructions if isinstance(i, KernelCall) and i.kernel == RECV)
    assert one.values[recv1.args[4]].value is False  # the stage reads it next


def test_a_plain_module_refuses_a_program_over_ranks(emu):
    with pytest.raises(ferry.DeviceError, match="ferry.distributed.Module"):
        ferry.Module(split_program())


def test_rank_spellings():
    d = ferry.Device.parse(" Rank2:CUDA:1")
    assert (d.type, d.index, d.rank, str(d)) == ("cuda", 1, 2, "rank2:cuda:1")
    assert ferry.Device.from_canonical("rank2:cuda:1") == d and d.local == ferry.Device("cuda", 1)
    assert str(ferry.Device.parse("rank0:cpu")) == "cpu:0"
    for bad in ("rank:cuda:0", "rank-1:cuda:0", "rank1:gpu:0", "rank1:rank2:cuda:0", "rank1234567890:cuda:0"):
        with pytest.raises(ValueError):
            ferry.Device.parse(bad)
    with pytest.raises(ValueError):
        ferry.Device.from_canonical("rank01:cuda:0")
    D = ferry.Device  # noqa: N806
    assert sorted([D("cuda", 1), D("cuda", 0, 1), D("cpu"), D("cuda", 0)]) == [
        D("cpu"), D("cuda", 0), D("cuda", 1), D("cuda", 0, 1)]  # a rank's devices list together


def test_inputs_and_outputs_on_another_rank_are_refused(emu):
    ep = torch.export.export(Stages().eval(), (torch.randn(4, 16),))
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(skip_d2h_for_method_outputs=True))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "emu:0", "b": "rank1:emu:0"}), cfg)
    with pytest.raises(ferry.ConfigError, match="output 0 lives on rank1:emu:0"):
        project(program, 0)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)
        return self.b(self.a(x)) * self.n


def test_micro_batches_refuse_a_stage_with_state_on_another_rank(emu):
    import ferry.distributed

    ep = torch.export.export(Counting().eval(), (torch.randn(4, 16),))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "emu:0", "b": "rank1:emu:0", "": "rank1:emu:0"}))
    with pytest.raises(ferry.ConfigError, match="holds the program.s state"):
        ferry.distributed.Module(program, microbatches=2)


def test_a_program_over_ranks_with_dynamic_sizes_is_refused_at_load(emu):
    ep = torch.export.export(Stages().eval(), (torch.randn(4, 16),),
                             dynamic_shapes=({0: torch.export.Dim("batch", max=8)},))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "emu:0", "b": "rank1:emu:0"}))
    with pytest.raises(ferry.ConfigError, match="static shapes"):
        project(program, 0)


def test_the_distributed_module_needs_a_job(emu, monkeypatch):
    import ferry.distributed

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ferry.ConfigError, match="torchrun"):
        ferry.distributed.Module(split_program())


# ---- two processes over Gloo


def _calls(n: int, batch: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g),) for _ in range(n)]


@pytest.mark.parametrize("options", [{}, {"asynchronous": True}, {"asynchronous": True, "graphs": True}],
                         ids=["sync", "async", "async+graphs"])
def test_two_ranks_equal_eager(tmp_path, options, emu):
    calls = _calls(5)
    zero, one = run_ranks(tmp_path, split_program(), calls, options)
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Stages().eval()
    for (x,), got in zip(calls, zero["outputs"]):
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
    # one send and one receive per rank: the two copies the report lists between ranks
    assert zero["transfers"] == one["transfers"] == 2


def test_micro_batches_pipeline_across_ranks(tmp_path, emu):
    calls = _calls(3, batch=10, seed=1)  # 10 rows in parts of 4: the last part is padded
    zero, one = run_ranks(tmp_path, split_program(batch=4), calls, {"microbatches": 3, "asynchronous": True})
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Stages().eval()
    for (x,), got in zip(calls, zero["outputs"]):
        assert got.shape == (10, 8)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)


class Keyed(Stages):
    def forward(self, x, *, shift):
        y = super().forward(x)
        return {"y": y + shift, "parts": (y, shift.sum())}


def test_rank_0_takes_keywords_and_returns_the_models_structure(tmp_path, emu):
    ep = torch.export.export(Keyed().eval(), (torch.randn(4, 16),), {"shift": torch.randn(4, 8)})
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "emu:0", "b": "rank1:emu:0"}))
    calls = [{"args": (x,), "kwargs": {"shift": torch.randn(4, 8)}} for (x,) in _calls(2, seed=3)]
    zero, one = run_ranks(tmp_path, program, calls)
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Keyed().eval()
    for call, got in zip(calls, zero["outputs"]):
        want = model(*call["args"], **call["kwargs"])
        assert isinstance(got, dict) and isinstance(got["parts"], tuple)
        torch.testing.assert_close(got["y"], want["y"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got["parts"][1], want["parts"][1], atol=1e-4, rtol=1e-4)


class WritesItsInput(Stages):
    """Rank 1 computes the input's new value; rank 0 writes it into the caller's tensor."""

    def forward(self, x):
        y = super().forward(x)
        x.copy_(self.a(x)[:, :16])
        return y


def test_an_input_written_in_place_is_written_on_rank_0(tmp_path, emu):
    ep = torch.export.export(WritesItsInput().eval(), (torch.randn(4, 16),))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "rank1:emu:0", "b": "emu:0"}))
    calls = _calls(3)
    zero, one = run_ranks(tmp_path, program, [tuple(t.clone() for t in c) for c in calls])
    assert "error" not in zero and "error" not in one, (zero, one)
    model = WritesItsInput().eval()
    for (x,), got, (after,) in zip(calls, zero["outputs"], zero["inputs_after"]):
        x = x.clone()
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(after, x, atol=1e-5, rtol=1e-4)


class Transposed(Stages):
    def forward(self, x):
        return super().forward(x).view(-1, 2, 4).transpose(1, 2)


def test_non_contiguous_tensors_cross_ranks(tmp_path, emu):
    """A result laid out transposed, and a caller's transposed input bound per micro-batch, move
    through contiguous staging (both transports move dense bytes; found by review)."""
    ep = torch.export.export(Transposed().eval(), (torch.randn(4, 16),))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "rank1:emu:0", "b": "rank1:emu:0"}))
    calls = [(torch.randn(16, 8, generator=torch.Generator().manual_seed(i)).t(),) for i in range(2)]
    assert not calls[0][0].is_contiguous()
    zero, one = run_ranks(tmp_path, program, calls, {"microbatches": 2})
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Transposed().eval()
    for (x,), got in zip(calls, zero["outputs"]):
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)


def test_a_bad_call_leaves_every_rank_ready_for_the_next(tmp_path, emu):
    """A call that fails its input checks (here on the dtype of a micro-batch) fails on rank 0
    before any other rank hears of it (found by review: rank 1 used to wait for data)."""
    good = _calls(2, batch=8)
    calls = [good[0], (torch.randn(8, 16, dtype=torch.float64),), good[1]]
    zero, one = run_ranks(tmp_path, split_program(), calls, {"microbatches": 2, "keep_going": True, "timeout": 20})
    assert zero["errors"] == ["InputError"] and "error" not in one, (zero, one)
    model = Stages().eval()
    for i in (0, 2):
        torch.testing.assert_close(zero["outputs"][i], model(calls[i][0]), atol=1e-5, rtol=1e-4)


def test_a_rank_that_dies_is_a_peer_error_on_rank_0_within_the_timeout(tmp_path, emu):
    zero, one = run_ranks(tmp_path, split_program(), _calls(4), {"die": {"1": 2}, "timeout": 20})
    assert one.get("exit") == 9
    assert zero["error"] == "PeerError" and "rank 1" in zero["message"], zero
    assert zero["seconds"] < 20 and len(zero["outputs"]) == 1


def test_rank_0_dying_stops_the_serving_rank_with_a_peer_error(tmp_path, emu):
    zero, one = run_ranks(tmp_path, split_program(), _calls(4), {"die": {"0": 2}, "timeout": 20})
    assert zero.get("exit") == 9
    assert one["error"] == "PeerError", one


def test_a_second_job_in_the_same_test_run_works(tmp_path, emu):
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        calls = _calls(2, seed=i)
        zero, _ = run_ranks(tmp_path / str(i), split_program(), calls)
        torch.testing.assert_close(zero["outputs"][-1], Stages().eval()(calls[-1][0]), atol=1e-5, rtol=1e-4)


# ---- NCCL on two GPUs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("options", [{}, {"graphs": True, "microbatches": 2}], ids=["plain", "graphs+microbatches"])
def test_two_gpus_on_two_ranks_over_nccl_equal_eager(tmp_path, options, full_fp32):
    calls = _calls(4, batch=8 if options.get("microbatches") else 4)
    program = split_program(first="cuda:0", second="rank1:cuda:1")
    assert [b.nccl for b in boundaries(program)] == [True, True]  # the output comes back through rank 0's GPU
    zero, one = run_ranks(tmp_path, program, calls, options)
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Stages().eval()
    for (x,), got in zip(calls, zero["outputs"]):
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)


# ---- the transport's waits, with a fake torch.distributed


class FakeWork:
    def __init__(self, done=True, error=None):
        self.done, self.error, self.waited = done, error, []

    def is_completed(self):
        return self.done

    def wait(self, timeout=None):
        self.waited.append(timeout)
        if self.error is not None:
            raise RuntimeError(self.error)


class FakeDist:
    def __init__(self, work):
        self.work, self.calls = work, []

    def isend(self, t, peer, group=None, tag=0):
        self.calls.append(("send", peer, group, tag, t))
        return self.work

    def irecv(self, t, peer, group=None, tag=0):
        self.calls.append(("recv", peer, group, tag, t))
        return self.work


def _transport(work, timeout=5.0):
    from ferry.runtime.parallel.transport import Groups, Transport

    return Transport(0, Groups("gloo", "control", {(0, 1): "nccl01", (1, 0): "nccl10"}), timeout, FakeDist(work))


def test_a_failed_gloo_transfer_is_a_peer_error_and_breaks_the_transport():
    t = torch.randn(4)
    transport = _transport(FakeWork(error="Connection closed by peer"))
    send = transport.bind_send(lambda: t, 1, 7, None, lambda: None)
    with pytest.raises(ferry.PeerError, match="sending to rank 1 .*Connection closed by peer"):
        send()
    assert transport.dist.calls[0][2:4] == ("gloo", 7)  # Gloo, tagged with the copy's instruction
    with pytest.raises(ferry.PeerError, match="earlier transfer failed"):
        send()


def test_an_nccl_request_that_never_completes_times_out(monkeypatch):
    from ferry.runtime.parallel import transport as module

    t = torch.randn(4)  # stands in for a GPU tensor: no staging
    monkeypatch.setattr(module._Twin, "empty", lambda self, fresh=False: t)
    work = FakeWork(done=False)
    transport = _transport(work, timeout=0.05)
    recv = transport.bind_recv(lambda: t, 1, 3, 0, False, lambda: None)
    recv()  # GPU memory over NCCL: ordered on the device (the stream waits), the host goes on
    assert work.waited == [None] and len(transport.pending) == 1
    with pytest.raises(ferry.PeerError, match="no answer within 0.05 s"):
        transport.finish()  # polled at the end of the call, bounded
    with pytest.raises(ferry.PeerError, match="earlier transfer failed"):
        recv()
    assert transport.dist.calls[0][2] == "nccl10"  # the direction rank 1 -> rank 0 has its own group


def test_a_deferred_receive_is_waited_for_at_the_end_of_the_call():
    work, t, synced = FakeWork(), torch.randn(4), []
    transport = _transport(work)
    recv = transport.bind_recv(lambda: t, 1, 3, None, True, lambda: synced.append(1))
    recv()
    assert synced == [1] and work.waited == [] and len(transport.pending) == 1
    transport.finish()
    assert len(work.waited) == 1 and work.waited[0].total_seconds() == 5.0 and transport.pending == []
    assert transport.dist.calls[0][4] is t  # host memory is received into directly, not staged


def test_staged_receives_left_pending_each_get_their_own_memory():
    """Micro-batches leave one output receive pending per part: a shared staging twin would
    hand every part the last part's rows (found on two H200s)."""
    work, t = FakeWork(), torch.empty(4, device="meta")
    transport = _transport(work)
    recv = transport.bind_recv(lambda: t, 1, 3, None, True, lambda: None)
    recv()
    recv()
    staged = [c[4] for c in transport.dist.calls]
    assert staged[0] is not staged[1] and all(s.device.type == "cpu" for s in staged)
    transport.finish()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_rank_that_dies_over_nccl_ends_rank_0_within_the_timeout(tmp_path):
    """Over NCCL a transfer stuck on a dead peer holds the device stream: rank 0's bounded
    waits give up with a PeerError before NCCL's own watchdog (set later) would end the process,
    and closing the module returns without hanging on NCCL's abort."""
    program = split_program(first="cuda:0", second="rank1:cuda:1")
    zero, one = run_ranks(tmp_path, program, _calls(4), {"die": {"1": 2}, "timeout": 15, "dump_after": 50,
                                                           "exit_after_peer_error": True}, limit=90)
    assert one.get("exit") == 9
    assert zero.get("error") == "PeerError" and "rank 1" in zero["message"], zero
    assert zero["seconds"] < 15 + 5, zero  # the timeout, not NCCL's watchdog (2 x 15 + 10 s)
    assert zero["closed_after"] < 10 and zero["exit"] == 3, zero  # close() returned; the job ends itself


def test_a_host_wait_stuck_behind_a_dead_peer_is_a_peer_error():
    """Device work queued behind a transfer that never completes: a host wait of a program over
    ranks gives up after the timeout with a PeerError instead of blocking forever."""
    from ferry.runtime.devices.simulated import SimulatedApi, _Mark
    from ferry.runtime.devices.streams import CopyStreams

    api = SimulatedApi()
    blocked = api.Stream(0)
    # internal: nothing public makes a receive that never completes: its mark and the host wait on it are queued by hand
    api._queue(blocked, ("wait", _Mark()))  # a receive whose peer never sends
    done = api.Event()
    done.record(blocked)
    assert not done.query()
    streams = CopyStreams(api)
    transport = _transport(FakeWork(), timeout=0.05)
    streams.bound_waits(transport.timeout, transport.stuck)
    streams._pending.append(done)
    with pytest.raises(ferry.PeerError, match="did not finish within 0.05 s"):
        streams.wait_host()
    assert transport.broken is not None


def test_the_cli_compiles_a_map_over_ranks_and_runs_it_only_under_a_job(tmp_path, capsys, emu, monkeypatch):
    from ferry.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "split.ferry"
    dmap = {"ln1": "emu:0", "qkv": "emu:0", "proj": "emu:0", "ln2": "rank1:emu:0", "fc1": "rank1:emu:0",
            "fc2": "rank1:emu:0"}
    assert main(["compile", "ferry.examples:transformer_block", "-o", str(out), "--device-map", json.dumps(dmap)]) == 0
    assert program_ranks(ferry.load_program(out)) == (0, 1)
    capsys.readouterr()
    assert main(["run", str(out)]) == 2  # one process, no job: say how to start one
    assert "torchrun" in capsys.readouterr().err
    dmap["fc2"] = "rank1:gpu:0"
    assert main(["compile", "ferry.examples:transformer_block", "-o", str(out), "--device-map", json.dumps(dmap)]) == 2
    assert "unknown device type 'gpu' in --device-map 'rank1:gpu:0'" in capsys.readouterr().err


def test_closing_after_a_peer_failure_does_not_hang_on_an_nccl_abort_that_blocks(monkeypatch):
    """NCCL's abort blocked on a transfer whose peer died (two H200s, torch 2.11), and any
    destroy then blocked behind it: closing gives the abort a bounded time, then leaves the
    groups to the process's end."""
    import threading
    import time

    from ferry.runtime.parallel import ranks as fd
    from ferry.runtime.parallel.transport import Groups

    class Nccl:
        def __init__(self, blocks):
            self.blocks, self.aborted = blocks, False

        def abort(self):
            if self.blocks:
                threading.Event().wait(5)
            self.aborted = True

    destroyed: list = []
    monkeypatch.setattr(fd, "_ABORT_WAIT", 0.05)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda g=None: destroyed.append(g))
    start = time.monotonic()
    # internal: leaving the groups is the step that must not hang, tested on its own
    assert not fd._leave(Groups("gloo", "control", {(0, 1): Nccl(blocks=True)}), False, clean=False)
    assert time.monotonic() - start < 1 and destroyed == []
    fine = Nccl(blocks=False)
    assert fd._leave(Groups("gloo", "control", {(0, 1): fine}), False, clean=False)
    assert fine.aborted and destroyed == [fine, "control", "gloo"]


def test_closing_keeps_what_a_failed_abort_left_and_frees_memory_first_otherwise(monkeypatch):
    """Clean: the module's memory is closed first (that waits for a call still running), then
    the groups. After a peer failed and NCCL's abort did not finish: the memory is neither freed
    nor left to the garbage collector (a stuck transfer may still write into it)."""
    from ferry.runtime.parallel import ranks as fd

    order: list = []

    class Local:
        def close(self):
            order.append("memory")

    def fake(leave_ok):
        m = object.__new__(fd.Module)
        # internal: a Module built without a job, its state set by hand, so close() runs without processes
        m.closed, m.rank, m._groups, m._owns_group = False, 1, "groups", False
        m.module, m.transport = Local(), type("T", (), {"broken": None})()
        return m

    monkeypatch.setattr(fd, "_leave", lambda groups, owns, clean: order.append(f"groups clean={clean}") or True)
    fake(True).close()
    assert order == ["memory", "groups clean=True"]
    order.clear()
    monkeypatch.setattr(fd, "_leave", lambda groups, owns, clean: order.append(f"groups clean={clean}") or False)
    broken = fake(False)
    broken.transport.broken = "rank 0 is gone"
    before = len(fd._ABANDONED)
    broken.close()
    assert order == ["groups clean=False"] and fd._ABANDONED[before][0] is broken.module
    fd._ABANDONED.pop()


def test_an_output_received_from_another_rank_is_made_for_the_caller(tmp_path, emu):
    """The last stage runs on rank 1's CPU: rank 0 receives the result straight into the output
    it hands the caller, which is allocated before the receive writes it and is the caller's
    own each call (found by review: the receive did not declare what it writes)."""
    ep = torch.export.export(Stages().eval(), (torch.randn(4, 16),))
    program = ferry.compile(ep, ferry.DeviceMapPartitioner({"a": "emu:0", "b": "rank1:cpu"}),
                            ferry.CompileConfig(alloc_graph_output=False))
    (out,) = program.method("forward").outputs
    assert program.method("forward").values[out].storage == "output"
    calls = _calls(3, seed=2)
    zero, one = run_ranks(tmp_path, program, calls)
    assert "error" not in zero and "error" not in one, (zero, one)
    model = Stages().eval()
    for (x,), got in zip(calls, zero["outputs"]):
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
