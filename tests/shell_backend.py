"""A third backend, written in the tests against the backend interface alone: each rank's
launcher is started by a ``/bin/sh -c LINE`` command line, the way ``ssh host LINE`` or
``srun ... LINE`` would start it on another machine."""

import shlex

from torchdist_magic.backends.launchers import CommandLineBackend


class ShellBackend(CommandLineBackend):
    name = "shell"
    #: every command line it ran, by rank (what the tests check reached a shell)
    commands = {}

    def describe(self):
        return "launchers started by /bin/sh command lines"

    def command(self, rank, argv):
        line = shlex.join(argv)
        ShellBackend.commands[rank] = line
        return ["/bin/sh", "-c", line]
