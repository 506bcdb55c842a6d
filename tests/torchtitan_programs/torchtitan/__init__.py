"""Stand-in for torchtitan's package ``__init__`` (which registers its quantization modules
and reads the installed version): the copies here need neither."""
