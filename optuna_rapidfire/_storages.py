"""Storage helpers: URLs without passwords (for logs and messages)."""

from __future__ import annotations


def hide_password(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs, errors and attributes)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: hide anything between "://user:" and "@"
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest and ":" in rest.split("@", 1)[0]:
            user = rest.split("@", 1)[0].split(":", 1)[0]
            return f"{scheme}://{user}:***@{rest.split('@', 1)[1]}"
        return url
