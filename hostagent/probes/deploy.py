"""What a deploy reads before it acts, in one run on the host: run there after env_setup as
`python3 - SPEC_JSON` with this file on standard input (bundled with the probes and modules it imports:
fleet.transport.hostcode.probe), it prints one JSON object, `{"needs": ..., "doctor": ..., "state": ...}`:

- `needs`: the lines the control node's check of what the step needs prints (fleet/host/preflight.py's shell
  script, run here in env_setup's environment: `missing tool ss`, `missing modules aiohttp`), or null
  when the spec asks for none (a deploy that takes the run lock has its holder check them first);
- `doctor`: the doctor probe's facts (hostagent/probes/doctor.py), hostagent.facts' `DoctorFacts` wire
  form, or null when the spec asks for none;
- `state`: the state probe's answer (hostagent/probes/state.py), hostagent.facts' wire form.

The three are read at once (threads): one round trip where they were three. Standard library only,
Python 3.7+; no side effects but the state probe's one (an instance seen healthy gets its ready marker).
"""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from hostagent.probes import doctor, state


def needs(script):
    """The preflight script's output lines (/bin/sh, whatever PATH env_setup left: the probe's own)."""
    r = subprocess.run(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit("the check of what the step needs failed (exit %d): %s" % (r.returncode, last))
    return r.stdout.splitlines()


def main():
    spec = json.loads(sys.argv[1])
    with ThreadPoolExecutor(max_workers=3) as pool:
        lines = pool.submit(needs, spec["needs"]) if spec.get("needs") else None
        found = pool.submit(doctor.read, spec["doctor"]) if spec.get("doctor") else None
        st = pool.submit(state.read, spec["state"])
        out = {"needs": lines.result() if lines else None, "doctor": asdict(found.result()) if found else None,
               "state": st.result()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
