class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""
