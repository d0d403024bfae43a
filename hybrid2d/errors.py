"""The error every room raises for a wrong setting or input, in a module of its own so that
raising it costs no import of the settings' schema (nor of the command line's parser)."""


class ConfigError(ValueError):
    """A setting is wrong; the message is one line naming it and what would work."""
