"""`dualpath profile run`'s arithmetic: roles, activities from stacks, totals and the floor (no root)."""
import pytest

from testbed.calibrate.run_profile import emulated_s, kernel_floor, kv_bytes_by_kind
from testbed.measure.cpu_profile import (ProcessCpu, activity_of, floor_summary, parse_raw, report_lines,
                                         role_of, split_by_activity, summarize)

ENGINE = ["/v/bin/python", "-m", "dualpath.nodes.engine", "--name", "dpt-d0e0", "--role", "decode"]


@pytest.mark.parametrize("argv, role", [
    (ENGINE, "decode engines"),
    (ENGINE[:-1] + ["prefill"], "prefill engines"),
    (["python", "-m", "dualpath.nodes.host", "--name", "dpt-p0"], "host agents"),
    (["python", "-m", "emulators.kvstore", "--listen", "x"], "store"),
    (["python", "-m", "testbed.cli", "run"], "cli and conductor"),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"], "verification"),
    (["tc", "-s", "class", "show"], "tools"),
    ([], "tools"),
])
def test_a_process_role_comes_from_its_command_line(argv, role):
    assert role_of(argv) == role


@pytest.mark.parametrize("frames, activity", [
    # the innermost project frame decides, whatever library runs under it
    (["main (dualpath/nodes/engine.py:10)", "load (dualpath/transport/nixl.py:40)", "cat (torch/functional.py:3)"],
     "kv transfer"),
    (["main (dualpath/nodes/engine.py:10)", "forward (dualpath/model/transformer.py:200)"], "model compute"),
    (["run (asyncio/base_events.py:1)", "call (dualpath/control.py:88)", "send (zmq/sugar/socket.py:5)"],
     "control rpcs"),
    (["pick (dualpath/scheduler/core.py:9)"], "scheduling"),
    (["wait (emulators/gpu/clock.py:12)"], "timing"),
    (["sample (testbed/measure/monitor.py:97)"], "monitoring"),
    (["main (dualpath/nodes/engine.py:10)"], "other python"),
    # verification and start-up hold for the whole stack below them
    (["check (testbed/cluster/verify.py:90)", "forward (dualpath/model/transformer.py:200)"], "verification"),
    (["<module> (dualpath/nodes/engine.py:1)", "_find_and_load (<frozen importlib._bootstrap>:1)"], "start-up"),
    # no project frame: by library
    (["run_forever (asyncio/base_events.py:600)", "select (selectors.py:468)"], "event loop"),
    (["mm (torch/nn/functional.py:1)"], "model compute"),
    ([], "other python"),
])
def test_a_stack_s_activity(frames, activity):
    assert activity_of(frames) == activity


RAW = [
    'process 10:"python -m testbed.cli run";process 11:"python -m dualpath.nodes.engine";'
    'main (dualpath/nodes/engine.py:5);forward (dualpath/model/transformer.py:9) 30',
    'process 10:"python -m testbed.cli run";process 11:"python -m dualpath.nodes.engine";thread (0x7f);'
    'main (dualpath/nodes/engine.py:5);send (dualpath/transport/nixl.py:1) 10',
    'process 10:"python -m testbed.cli run";go (testbed/cluster/conductor.py:3) 5',
    # a command line with ';' in it (multiprocessing's spawned workers)
    'process 10:"python -m testbed.cli run";process 12:"python -c from m import f; f(fd=5)";'
    'check (testbed/cluster/verify.py:90);forward (dualpath/model/transformer.py:9) 7',
    "garbage without a count",
    "",
]


def test_raw_stacks_are_counted_per_process_and_activity():
    s = parse_raw(RAW)
    assert s.samples == 52
    assert s.by_pid == {11: {"model compute": 30, "kv transfer": 10}, 10: {"other python": 5},
                        12: {"verification": 7}}
    assert s.argv[12] == "python -c from m import f; f(fd=5)"
    assert s.argv[11] == "python -m dualpath.nodes.engine"
    assert s.leaves["forward (dualpath/model/transformer.py:9)"] == 37


def test_measured_cpu_is_split_in_the_shares_of_the_samples():
    procs = [ProcessCpu(11, "decode engines", 3.0, 1.0), ProcessCpu(10, "cli and conductor", 2.0, 0.0),
             ProcessCpu(13, "tools", 0.5, 0.5)]
    split = split_by_activity(procs, parse_raw(RAW))
    assert split["decode engines"] == pytest.approx({"model compute": 3.0, "kv transfer": 1.0})
    assert split["cli and conductor"] == pytest.approx({"other python": 2.0})
    assert split["tools"] == {"unsampled": 1.0}  # no samples: its CPU still counts


def test_summary_totals_kernel_and_what_no_process_explains():
    procs = [ProcessCpu(11, "decode engines", 3.0, 1.0), ProcessCpu(10, "cli and conductor", 2.0, 0.0)]
    s = summarize(procs, parse_raw(RAW), machine_busy_s=10.0, kernel_s=1.5, profiler_s=0.5, emulated_s=2.0,
                  wall_s=10.0, cores=2)
    # 4 + 2 in processes, 1.5 kernel, 10 - 0.5 - 7.5 = 2 unattributed
    assert s["by_role"] == {"decode engines": 4.0, "unattributed": 2.0, "cli and conductor": 2.0, "kernel": 1.5}
    assert s["cpu_s"] == 9.5 and s["cpu_s_per_emulated_s"] == 4.75
    assert s["cpu_share_of_machine"] == 0.475
    assert s["by_activity"]["model compute"] == 3.0
    assert "floor" not in s
    # counters read a moment apart never make the remainder negative
    s = summarize(procs, parse_raw(RAW), machine_busy_s=5.0, kernel_s=1.5, profiler_s=0.5, emulated_s=2.0,
                  wall_s=10.0, cores=2)
    assert s["by_role"]["unattributed"] == 0.0


def test_the_floor_and_how_far_above_it_the_run_is():
    fl = floor_summary(1.0, {"prefilled": 100, "decoded": 10, "requests": 2}, 2_000_000_000, 0.5, None)
    assert fl["kernel_cpu_s"] == 1.0 and fl["cpu_s"] == 2.0
    s = summarize([ProcessCpu(1, "prefill engines", 8.0, 0.0)], parse_raw([]), machine_busy_s=8.0, kernel_s=0.0,
                  profiler_s=0.0, emulated_s=4.0, wall_s=8.0, cores=2, floor=fl)
    assert s["floor"]["cpu_s_per_emulated_s"] == 0.5 and s["over_floor"] == 4.0
    text = "\n".join(report_lines(s))
    assert "4.0x its floor" in text and "prefill engines" in text
    # without iperf3's cost the kernel's part is unknown, not zero
    assert floor_summary(1.0, {}, 10, None, None)["kernel_cpu_s"] is None


def test_a_run_summary_gives_emulated_time_and_bytes_by_nic_kind():
    summary = {"modes": {
        "basic": {"jct_s": 2.5, "kv_bytes_vs_expected": {"per_direction": [
            {"nic": "dpt-p0/snic", "dir": "rx", "measured": 900},
            {"nic": "dpt-s0/storage_nic", "dir": "tx", "measured": 1000},
            {"nic": "dpt-p0e0/cnic", "dir": "tx", "measured": 300}]}},
        "dualpath": {"jct_s": 1.5, "kv_bytes_vs_expected": {"per_direction": [
            {"nic": "dpt-s0/storage_nic", "dir": "tx", "measured": 500}]}}}}
    assert emulated_s(summary) == 4.0
    kinds = kv_bytes_by_kind(summary)
    assert kinds == {"storage_nic": 1500, "cnic": 300}
    cost = {"snic": {"cpu_s_per_gb": 2.0}, "cnic": {"cpu_s_per_gb": 1.0}}
    total, per_gb = kernel_floor(kinds, cost)
    assert total == 1800 and per_gb == pytest.approx((1500 * 2.0 + 300 * 1.0) / 1800)
    assert kernel_floor(kinds, {"snic": {"cpu_s_per_gb": None}})[1] is None


def test_the_cpu_while_the_modes_ran_comes_from_their_start_and_verdict_lines():
    from testbed.measure.cpu_profile import in_modes, mode_mark

    assert mode_mark("  mode dualpath\n") == ("dualpath", "start")
    assert mode_mark("  mode basic with 2 fault(s)") == ("basic", "start")
    assert mode_mark("    basic: UNFAITHFUL, JCT 3.1 s emulated (15 s here), CPU busy 40%") == ("basic", "end")
    assert mode_mark("    basic: 23/234 requests") is None and mode_mark("  cluster up in 0.1s") is None
    marks = [("basic", "start", {"prefill engines": 1.0, "kernel": 10.0}),
             ("basic", "end", {"prefill engines": 5.0, "kernel": 11.0, "host agents": 2.0}),
             ("dualpath", "start", {"prefill engines": 6.0, "kernel": 11.5}),
             ("dualpath", "end", {"prefill engines": 8.0, "kernel": 12.5})]
    got = in_modes(marks, {"basic": 2.0, "dualpath": 1.0, "oracle": 9.0})  # oracle never ran here
    assert got["by_role"] == {"prefill engines": 6.0, "kernel": 2.0, "host agents": 2.0}
    assert got["cpu_s"] == 10.0 and got["emulated_s"] == 3.0 and got["cpu_s_per_emulated_s"] == 3.333
    assert in_modes([], {"basic": 2.0})["cpu_s_per_emulated_s"] is None


def test_a_thread_sampled_at_a_blocking_call_is_waiting_and_splits_no_cpu():
    from testbed.measure.cpu_profile import WAITING

    src = {("dualpath/nodes/host.py", 149): "            time.sleep(self.every_s)\n",
           ("zmq/sugar/poll.py", 106): "        return zmq_poll(self.sockets, timeout=timeout)\n",
           ("dualpath/model/transformer.py", 9): "        x = self._attend(x)\n"}
    raw = ['process 5:"python -m dualpath.nodes.host";_watch (dualpath/nodes/host.py:149) 40',
           'process 5:"python -m dualpath.nodes.host";serve (dualpath/nodes/x.py:1);poll (zmq/sugar/poll.py:106) 20',
           'process 5:"python -m dualpath.nodes.host";forward (dualpath/model/transformer.py:9) 10',
           'process 5:"python -m dualpath.nodes.host";forward (unknown/file.py:3) 10']
    s = parse_raw(raw, lambda f, n: src.get((f, n), ""))
    assert s.by_pid[5] == {WAITING: 60, "model compute": 10, "other python": 10}
    split = split_by_activity([ProcessCpu(5, "host agents", 2.0, 0.0)], s)
    assert split["host agents"] == pytest.approx({"model compute": 1.0, "other python": 1.0})
    assert "_watch (dualpath/nodes/host.py:149)" not in s.leaves
