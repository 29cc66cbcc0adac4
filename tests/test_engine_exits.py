"""A dead engine's error names its cause: the exit status or signal of its processes, and the
out-of-memory killer when the kernel's count rose since the boot (the real SIGKILL of an engine
core: tests/test_provider.py::test_engine_death_fails_samples_clearly_and_the_next_eval_recovers)."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

from inspect_tl_vllm.engine import exits


def engine_with_exits(codes: dict[str, int]) -> SimpleNamespace:
    """What ``why_engine_died`` reads of an ``AsyncLLM``: its process manager's finished processes."""
    manager = SimpleNamespace(finished_procs=lambda: codes)
    return SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))


def memory_events(tmp_path: Path, kills: int) -> Path:
    path = tmp_path / "memory.events"
    path.write_text(f"low 0\nhigh 0\nmax 3\noom {kills}\noom_kill {kills}\noom_group_kill 0\n")
    return path


def test_the_oom_kill_count_is_read_from_memory_events(tmp_path):
    assert exits.oom_kills(memory_events(tmp_path, 7)) == 7
    assert exits.oom_kills(tmp_path / "missing") is None
    (tmp_path / "other").write_text("low 0\n")
    assert exits.oom_kills(tmp_path / "other") is None


def test_an_engine_killed_by_the_out_of_memory_killer_says_so_and_what_to_lower(tmp_path):
    events = memory_events(tmp_path, 3)
    why = exits.why_engine_died(engine_with_exits({"EngineCore_DP0": -signal.SIGKILL}), 1, events)
    assert why.startswith("EngineCore_DP0 was killed by SIGKILL; ")
    assert "out-of-memory killer ended 2 process(es)" in why and "-M max_num_seqs" in why
    assert "dmesg" not in why


def test_a_sigkill_without_an_oom_count_names_both_possible_senders(tmp_path):
    events = memory_events(tmp_path, 1)
    why = exits.why_engine_died(engine_with_exits({"EngineCore_DP0": -signal.SIGKILL}), 1, events)
    assert "was killed by SIGKILL" in why and "another process or from the kernel's out-of-memory killer" in why
    unknown = exits.why_engine_died(engine_with_exits({"EngineCore_DP0": -signal.SIGKILL}), None, events)
    assert "dmesg" in unknown  # no count at boot: nothing to compare, the hint stays


def test_an_engine_that_exited_gives_its_status_and_no_memory_advice(tmp_path):
    events = memory_events(tmp_path, 0)
    why = exits.why_engine_died(engine_with_exits({"EngineCore_DP0": 1}), 0, events)
    assert why == "EngineCore_DP0 exited with status 1"
    nothing = exits.why_engine_died(SimpleNamespace(), 0, events)  # no process manager to ask
    assert nothing == "no engine process reported an exit status"
