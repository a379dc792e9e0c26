"""The finished implementations, generated from the solution cells of source/ by `make build`.

One module per kernel family: autograder/building/build.py writes each from the cells of one notebook tagged
for it, "export" for the assignment's own module (04_triton_flash -> triton_flash.py) and "export:<module>"
for another (05: fast_attention, decode, fast_lse; 08: longest_first, fp8, hopper, any_input). Later chapters, tests and
benchmarks import them. Edit the notebook in source/, never these files.
"""
