"""Notebook support for the book: run profiles, the results writer, the figure style and
the runner that executes chapters and builds the book.

In a chapter's setup cell::

    from labkit.book import Results, current_profile, pick, use_book_style, new_figure

    profile = current_profile(profile)      # "ci" or "full", from the parameters cell
    use_book_style()
    res = Results("ch01", profile=profile, model="smollm2-135m")
"""

from labkit.book.profile import (
    PROFILES,
    current_profile,
    install_cell_source,
    pick,
    repository_url,
)
from labkit.book.results import NOT_RUN, ChapterResults, Results, glue
from labkit.book.style import new_figure, use_book_style

__all__ = [
    "PROFILES",
    "current_profile",
    "pick",
    "install_cell_source",
    "repository_url",
    "Results",
    "ChapterResults",
    "NOT_RUN",
    "glue",
    "use_book_style",
    "new_figure",
]
