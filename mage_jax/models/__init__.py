"""Decoder models: configuration, the NNX transformer, Hugging Face loading, sharding.

Modules are imported by name (``models.config``, ``models.transformer``, ...): a package ``__init__``
that imported them would be in an import cycle with each."""
