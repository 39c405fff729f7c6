"""What a run is told: the command line and its YAML files, and the enumerated choices and Transformer Engine
checks it validates against. It imports only `angpt.data` (the blend syntax), and neither torch nor
megatron-core at the top, so that `--help` prints before they load.
"""
