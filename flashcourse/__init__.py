"""flashcourse: the library behind the FlashAttention course notebooks.

runtime    decides once between a GPU and the Triton interpreter (every notebook starts with it)
reference  the unfused attention spec every check compares with
checks     comparisons whose failure messages name the learner's likely mistake
engine     the finished implementations, generated from the solution cells of source/
"""

__version__ = "0.1.0"
