"""A trainer rank that died is named with what it was doing and the end of its stderr (issue 47: a
heap corruption in a trainer actor left only "the actor died" in the test's output). The file layout
is Ray's (worker-<worker id>-<job id>-<pid>.err); a real abort in a Ray actor writes glibc's message,
Ray's native stack and faulthandler's stacks there."""

from __future__ import annotations

from types import SimpleNamespace

from mcore_rl.actor.deaths import TAIL_LINES, stderr_tail, trainer_died


class Handle:  # what trainer_died reads of a Ray actor handle: its id
    def __init__(self, hex_id):
        self._actor_id = SimpleNamespace(hex=lambda: hex_id)


class ActorDied(RuntimeError):  # what it reads of Ray's RayActorError: its text and the actor's id
    def __init__(self, message, actor_id):
        super().__init__(message)
        self.actor_id = actor_id


def test_a_dead_rank_is_named_with_the_end_of_its_stderr(tmp_path):
    pid = 4242
    crash = ["malloc(): unaligned tcache chunk detected", "*** SIGABRT received at time=1 on cpu 0 ***",
             "Fatal Python error: Aborted", "", "Thread 0x00007f (most recent call first):",
             '  File "mcore_rl/checkpoint/model.py", line 125 in write']
    noise = [f"noise {i}" for i in range(200)]
    (tmp_path / f"worker-ab12-01000000-{pid}.err").write_text("\n".join(noise + crash) + "\n")
    (tmp_path / "worker-cd34-01000000-9999.err").write_text("another worker's crash\n")
    died = trainer_died(ActorDied("The actor died unexpectedly before finishing this task.\n\tpid: 4242", "bb"),
                        "update", [Handle("aa"), Handle("bb")], [1111, pid], logs=str(tmp_path))
    text = str(died)
    assert text.splitlines()[0] == ("trainer rank 1 (pid 4242) died during update: "
                                    "The actor died unexpectedly before finishing this task.")
    assert text.endswith("\n".join(crash)) and "another worker" not in text
    assert len(stderr_tail(pid, str(tmp_path)).splitlines()) == TAIL_LINES
    # no log file here (a rank of another node), an actor not in the group: still the one line
    assert str(trainer_died(ActorDied("gone", "aa"), "log_probs", [Handle("aa")], [7], logs=str(tmp_path))) == \
        "trainer rank 0 (pid 7) died during log_probs: gone"
    assert str(trainer_died(ActorDied("gone", "zz"), "save", [Handle("aa")], [7], logs=None)) == \
        "a trainer rank died during save: gone"
