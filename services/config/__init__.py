"""Deployment configuration: one YAML file per deployment, loaded into frozen dataclasses."""
from services.config.errors import ConfigError
from services.config.load import load_config, parse_config
from services.config.schema import (
    CachePoolConfig,
    DeploymentConfig,
    EngineConfig,
    LoggingConfig,
    ModelConfig,
    QosClassConfig,
    RoleFlipsConfig,
    RouterConfig,
    SchedulerConfig,
    SupervisorConfig,
    WorkerConfig,
)

__all__ = [
    "CachePoolConfig",
    "ConfigError",
    "DeploymentConfig",
    "EngineConfig",
    "LoggingConfig",
    "ModelConfig",
    "QosClassConfig",
    "RoleFlipsConfig",
    "RouterConfig",
    "SchedulerConfig",
    "SupervisorConfig",
    "WorkerConfig",
    "load_config",
    "parse_config",
]
