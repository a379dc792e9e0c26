"""A notebook kernel's resource limits, set by the process that becomes the kernel: bubblewrap's child
(autograder/jail.py) or a kernel forked from the warm template (autograder/forkserver.py). The template
runs inside the jail, which holds this file but not the rest of the grader, so both use it from here."""

import resource


def apply(limits: dict, gpu: bool) -> None:
    """Set every limit, hard ones included, from jail.Limits' fields. A kernel given a GPU has no address-space
    limit: CUDA reserves far more address space than it ever uses."""
    space = resource.RLIM_INFINITY if gpu else int(limits["address_space"])
    for kind, value in ((resource.RLIMIT_CPU, limits["cpu_seconds"]), (resource.RLIMIT_AS, space),
                        (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_size"]),
                        (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (int(value), int(value)))
