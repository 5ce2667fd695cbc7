"""The two ways a run is refused before any compute: a bad config, or a machine that cannot run it."""


class EnvironmentProblem(Exception):
    """The machine, not the config, stops a run: missing or damaged data, a folder that cannot
    be written, a full disk, no SLURM. Reported like a bad config value: one or two lines on
    stderr naming the file or folder and the fix, exit status :attr:`exit_code`."""
    exit_code = 2


class ConfigError(ValueError):
    """A bad config: reported in one line, exit status 2, before any compute."""
