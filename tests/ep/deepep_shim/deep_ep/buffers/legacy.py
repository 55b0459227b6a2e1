from tritile.ep import Buffer  # noqa: F401
