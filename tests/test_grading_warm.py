"""The warm nbgrader server (autograder/grading/warm.py): every command in a fresh child, limited, killed at its
timeout, a server that dies is replaced, and its kernel template leaves no folder behind."""

import os
import threading

import pytest

from autograder.grading import warm
from autograder.jail.sandbox import descendants


@pytest.fixture(scope="module")
def server():
    return warm.server()


def _version(server, tmp_path, name, **options):
    log = tmp_path / f"{name}.log"
    return server.run(["--version"], str(log), 120, **options), log.read_text()


def test_commands_run_at_once_each_in_its_own_child(server, tmp_path):
    """Two commands sent from two threads both run to the end, each writing its own log."""
    answers = {}
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, _version(server, tmp_path, n)))
               for n in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert set(answers) == {"one", "two"}
    for code, log in answers.values():
        assert code == 0 and "nbgrader version" in log, log


def test_a_failing_command_says_why(server, tmp_path):
    """A command that fails exits non-zero with nbgrader's own message in its log."""
    log = tmp_path / "failing.log"
    code = server.run(["db", "student", "remove", "nobody", f"--CourseDirectory.db_url=sqlite:///{tmp_path / 'g.db'}"],
                      str(log), 120)
    assert code not in (0, None, warm.LOST)
    assert "No such student: 'nobody'" in log.read_text()


def test_the_memory_limit_applies_to_the_child(server, tmp_path):
    """A command limited to 1 MiB of address space fails to map what it needs (the server holds far more);
    the same command without the limit runs, and the server is unaffected."""
    def students(name, **options):
        log = tmp_path / f"{name}.log"
        return server.run(["db", "student", "list", f"--CourseDirectory.db_url=sqlite:///{tmp_path / name}.db"],
                          str(log), 120, **options), log.read_text()

    code, log = students("small", memory=1 << 20)
    assert code not in (0, None), log
    assert students("unlimited")[0] == 0


def test_a_command_past_its_timeout_is_killed(server, tmp_path):
    """None at the timeout; the child's process group is gone and the server keeps serving."""
    children_before = set(descendants(server.process.pid))
    log = tmp_path / "slow.log"
    assert server.run(["autograde", "nothing", "--force"], str(log), 0.001) is None
    assert set(descendants(server.process.pid)) <= children_before
    assert _version(server, tmp_path, "next")[0] == 0


def test_a_dead_server_is_replaced(tmp_path, monkeypatch):
    """After the server is killed, the next call starts a fresh one that runs commands."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a server killed outright cannot remove its template's folder
    monkeypatch.setattr(warm, "_server", warm.Server())  # the session's own server is left alone
    first = warm.server()
    first.process.kill()
    first.process.wait()
    second = warm.server()
    try:
        assert second is not first and second.alive()
        assert _version(second, tmp_path, "fresh")[0] == 0
    finally:
        second.close()


def test_the_kernel_template_leaves_nothing_behind(tmp_path, monkeypatch):
    """A root grader's kernel template keeps its files in a folder of its own, removed when the server ends."""
    from autograder.jail import sandbox as jail

    if os.geteuid() != 0 or jail.why_no_jail() is not None:
        pytest.skip("a kernel template needs a root grader that can build a jail")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))   # where the server's tempfile puts the template's folder
    server = warm.Server()
    try:
        assert _version(server, tmp_path, "first")[0] == 0   # answered: the template started before the loop
        assert [p.name.startswith("flashcourse-template-") for p in scratch.iterdir()] == [True]
    finally:
        server.close()
    assert list(scratch.iterdir()) == [], "the kernel template's folder outlived the server"
