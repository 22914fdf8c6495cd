"""Settings of a chatkv process (`Settings`, every field also a `CHATKV_<FIELD>` variable) and the
sub-configs it builds for the parts that consume fields together.

    settings.py   Settings: fields, environment defaults, derived budgets, the sub-config builders
    configs.py    ModelConfig, WindowConfig, TierConfig, RedisConfig, ReplicaConfig
    checks.py     what one field's value must be (one rule table for Settings and sub-configs)
    parsing.py    text to values: byte sizes, durations, booleans, integers

Torch-free: the admin CLI imports it to talk to a server.
"""

from __future__ import annotations

from sessions.engine.config import SchedulerConfig
from sessions.settings.checks import DtypeName, DtypeSetting, PersistMode, Precision, RoutingMode, WindowPolicyName
from sessions.settings.configs import ModelConfig, RedisConfig, ReplicaConfig, TierConfig, WindowConfig
from sessions.settings.parsing import MAX_DURATION_S, env_variable, parse_bytes, parse_duration_s
from sessions.settings.settings import (
    BUNDLED_MODEL_NAME,
    DEFAULT_MODEL,
    REPLICA_ID_FILE,
    Settings,
    default_home,
    default_model_cache_dir,
)

__all__ = [
    "BUNDLED_MODEL_NAME",
    "DEFAULT_MODEL",
    "MAX_DURATION_S",
    "REPLICA_ID_FILE",
    "DtypeName",
    "DtypeSetting",
    "ModelConfig",
    "PersistMode",
    "Precision",
    "RedisConfig",
    "ReplicaConfig",
    "RoutingMode",
    "SchedulerConfig",
    "Settings",
    "TierConfig",
    "WindowConfig",
    "WindowPolicyName",
    "default_home",
    "default_model_cache_dir",
    "env_variable",
    "parse_bytes",
    "parse_duration_s",
]
