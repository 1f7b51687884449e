"""The inventory and a host's settings: the YAML's layers validated against the schema into `HostVars`,
what follows from them computed once (serving: groups, instances, cards, slots; cluster: entry hosts and
members), the accelerators' kinds, and the inventory reference written from the schema."""
