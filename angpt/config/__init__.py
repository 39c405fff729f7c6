"""What a run is told: its configuration in typed sections (`sections`), the command line built from them
(`parser`), the command line and its YAML files read (`arguments`) and validated into a configuration
(`validation`), the flags an older checkpoint recorded read the same way (`saved`), and the enumerated choices
and Transformer Engine checks it validates against. It imports nothing else of angpt, and neither torch nor
megatron-core except in `batch_schedule` (the trainer's; validation imports it for a ramp-up only), so that
`--help` prints before they load.
"""
