"""Start the grader as an ordinary user who is delegated a cgroup of its own, so that its jails are kept apart.

    python -m autograder.jail.delegate --user grader -- python -m autograder grade /submitted

The course's image (Dockerfile) starts every command this way. Run as root, it makes a group for the user (cgroup
v2: one group below this process's own, with the memory and pids controllers enabled for it; v1: one in each of
the memory and pids hierarchies), gives the user the group's files that delegation hands over (the folder,
cgroup.procs, cgroup.threads and cgroup.subtree_control, or v1's tasks), moves itself in, drops to the user and
runs the command. The grader then finds the group as its own (autograder/jail/cgroups.py) and makes each jail's
groups inside it. Where no group can be made (Docker mounts /sys/fs/cgroup read-only in a container that is not
privileged; Podman mounts it writable with `--security-opt unmask=/sys/fs/cgroup`), it says so on stderr and
runs the command all the same: the grader then grades one notebook at a time and its summary says why. Run as
anyone else, it only runs the command.
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
from pathlib import Path

from autograder.jail import cgroups

GROUP = "grader"                                   # the delegated group's name, below this process's own group
HANDED_OVER = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "tasks")  # those a group has are chowned


def delegated_groups(uid: int, gid: int) -> list[Path]:
    """Make the user's group(s) and hand them over; the folders made. OSError where none can be made."""
    mounts, own = cgroups._mounts(), cgroups._own()
    v2 = next((Path(m) for m, kind, _ in mounts if kind == "cgroup2"), None)
    if v2 is not None and "" in own and set(cgroups.CONTROLLERS) <= set((v2 / "cgroup.controllers").read_text().split()):
        top = v2 / own[""].lstrip("/")
        if not cgroups._enable(top):   # a container's processes start in its root group: move them out first
            cgroups.move_to_leaf(top, "init")
            if not cgroups._enable(top):
                raise OSError(f"the memory and pids controllers cannot be enabled below {top}")
        made = [top / GROUP]
    else:
        made = []
        for controller in cgroups.CONTROLLERS:
            mount = next((Path(m) for m, kind, options in mounts if kind == "cgroup" and controller in options), None)
            if mount is None or controller not in own:
                raise OSError(f"no cgroup hierarchy with the {controller} controller is mounted")
            made.append(mount / own[controller].lstrip("/") / GROUP)
    for group in made:
        group.mkdir(exist_ok=True)
        os.chown(group, uid, gid)
        for name in HANDED_OVER:
            if (group / name).exists():
                os.chown(group / name, uid, gid)
    return made


def enter(groups: list[Path]) -> None:
    """Move the calling process into the groups: what it starts from then on is born there."""
    for group in groups:
        cgroups._write(group / "cgroup.procs", str(os.getpid()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--user", required=True, help="the ordinary user to run the command as (a name or a uid)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if os.geteuid() == 0:
        user = pwd.getpwuid(int(args.user)) if args.user.isdigit() else pwd.getpwnam(args.user)
        try:
            enter(delegated_groups(user.pw_uid, user.pw_gid))
        except OSError as error:
            print(f"delegate: no cgroup could be delegated to {user.pw_name} ({error}): the grader will grade one "
                  "notebook at a time", file=sys.stderr)
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
        os.environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    os.execvp(command[0], command)
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())
