"""What a deploy will do, decided from the wanted (the settings, the rendered files) and the found (the
facts) with no I/O: the plan's steps, each with its reason, an instance's launch against the one it runs,
and what a deploy would undo of a running deployment."""
