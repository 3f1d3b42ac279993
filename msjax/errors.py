"""The one error type for user mistakes; the CLIs turn it into one line on stderr and exit 2."""


class MsjaxError(Exception):
    """A problem the user can fix: a bad config value, a missing file, an impossible mesh."""


class ConfigError(MsjaxError):
    """A config key, value or combination that msjax does not accept."""
