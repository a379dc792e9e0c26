"""The jail: what runs a learner's code and how it is confined.

sandbox   builds the bubblewrap jail (namespaces, mounts, identity, limits), starts kernels in it, cold or
          forked from a warm template, and measures them from outside
cgroups   a control group per jail where one can be had: its tasks and memory capped apart from others'
inside/   the programs that run inside the jail, copied into it whole and nothing else of the grader:
          the runner, the wire format, the limits, the fork server, the plot backend, the kernel host
"""
