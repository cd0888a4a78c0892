"""ampctl's configs: the YAML groups, their schemas, and Hydra's settings for each command.

`${ampctl.path_safe:...}` names a sweep's job directories (train.yaml's hydra.sweep.subdir): Hydra's
override_dirname keeps a value's `/` (recipe.data_root=~/data/pets, train.checkpoint.mirror=s3://b/run), which made
each such job a directory nested under others, where the sweep's table did not find it. Registered here, where
every process that composes or runs a job (a launcher's, a submitit or Ray job) imports ampctl's configs."""

from omegaconf import OmegaConf

OmegaConf.register_new_resolver("ampctl.path_safe", lambda name: str(name).replace("/", "_"), replace=True)
