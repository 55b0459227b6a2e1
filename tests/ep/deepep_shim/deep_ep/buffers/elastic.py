from tritile.ep import ElasticBuffer, EPHandle  # noqa: F401
