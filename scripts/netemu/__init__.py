"""Network emulator library for the scripts/ entry points: tc rules, namespace hosts, SSH, probes.

Pure logic (tc rule generation, host lists) lives in `tcrules` and `hostlist`; the modules that
touch the machine (`netns`, `sshctl`, `probe`) import them, never the other way round.
"""
