"""The book's colours, line styles and markers, beneath everything that draws: the figure
style (`labkit.book.style`) and the chapter experiments' plots both take them from here."""

# Okabe & Ito (2008) palette, black moved last; safe for the common colour-vision deficiencies.
OKABE_ITO = [
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#F0E442",  # yellow
    "#000000",  # black
]
LINESTYLES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
