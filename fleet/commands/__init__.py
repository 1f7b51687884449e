"""What the operator types: one module per command (`inv deploy`, `inv stop`, `inv swap-to-nginx`, ...), and
what the commands alone share (running one on many hosts, the text they print, an entry's member set aside
while it restarts). Above every other room: nothing below imports a command."""
