"""Bounds shared by the mesh's signed JSON objects: a capacity summary
(:mod:`viiwork.mesh.summary`) and its extensions (:mod:`viiwork.mesh.extensions`) hold
their model names, labels and integers to the same limits (docs/mesh.md, "Limits")."""

MAX_MODELS = 64  # models in one summary (and model entries in one extension)
MAX_NAME_CHARS = 200  # a model's name
MAX_LABEL_CHARS = 64  # an engine, kind or other short label
MAX_INT = 2**53  # JSON-safe; integers beyond this are malformed


def control_char(text: str) -> str | None:
    """The first control character in ``text`` (C0 U+0000..U+001F, DEL U+007F, C1
    U+0080..U+009F: what a terminal may act on, as in ESC [ 2 J), or None when it holds none.

    Every string of a summary obeys this (docs/mesh.md, "Limits"): a peer's names reach
    operators' terminals (``viiworkctl mesh``) and logs. The ranges are fixed code points,
    not Unicode categories, so that every version of the agent draws the line in one place.
    """
    for c in text:
        if c < "\x20" or "\x7f" <= c <= "\x9f":
            return c
    return None


def model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model name, or None when it can: no whitespace and only
    printable characters (``str.isprintable``: no control character, no format character such
    as U+202E). The config loader and the summary decoder apply this one rule, so a name a
    node publishes is one every peer accepts."""
    if any(c.isspace() or not c.isprintable() for c in name):  # isprintable is False for C0, DEL, C1
        return "model name may not contain spaces or control characters"
    return None
