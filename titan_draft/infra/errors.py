"""The error every check raises: one line naming the key or file and the fix (a leaf module, so that
config.validate can call the checks of the modules it imports without an import cycle)."""


class ConfigError(ValueError):
    """A configuration value or input file that cannot work; the message names the key and the fix."""
