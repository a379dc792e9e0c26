"""matplotlib's backend inside the grading jail: a figure comes back as a PNG output of the cell that drew it.

The runner (autograder/jail/inside/runner.py) names this module in MPLBACKEND, so matplotlib is imported only by a
notebook that plots, not by every kernel at start-up. `plt.show()` and the end of each cell both
display the open figures and close them, as Jupyter's inline backend does.
"""

import base64
import io

from matplotlib.backend_bases import FigureManagerBase as FigureManager  # noqa: F401  (what a backend provides)
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa: F401


def show(*args, **kwargs) -> None:
    display_open_figures()


def display_open_figures() -> None:
    """Display every open figure as PNG, then close them all."""
    from IPython.display import display
    from matplotlib import pyplot

    for number in pyplot.get_fignums():
        png = io.BytesIO()
        pyplot.figure(number).savefig(png, format="png", bbox_inches="tight")
        display({"image/png": base64.b64encode(png.getvalue()).decode(), "text/plain": f"<Figure {number}>"},
                raw=True)
    pyplot.close("all")
