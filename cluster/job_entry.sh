#!/bin/sh
# The entrypoint of a `raygrpo submit` job: `sh cluster/job_entry.sh train CONFIG overrides...`.
#
# Ray runs a job's entrypoint with /bin/sh in the working dir (our uploaded project), with the
# environment of its job supervisor, a Ray worker. Its PATH is whatever the head was started
# with, so a bare `python` may not be the interpreter Ray runs on: `.venv/bin/ray start --head`
# without activating the venv makes it the system Python ("No module named 'torch'"). The
# interpreter Ray starts its workers with is the node raylet's --python_worker_command; the
# raylet is an ancestor of this shell (raylet -> supervisor -> sh), so walk up to it. Only
# without /proc (not Linux) fall back to python3 on PATH. cluster/job_entry.py then checks that
# interpreter has our dependencies before anything imports them.
py=""
pid=$PPID
while [ -z "$py" ] && [ -n "$pid" ] && [ "$pid" -gt 1 ] && [ -r "/proc/$pid/cmdline" ]; do
    py=$(tr '\0' '\n' < "/proc/$pid/cmdline" | sed -n 's/^--python_worker_command=\([^ ]*\).*/\1/p' | head -n 1)
    pid=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$pid/status")
done
if [ -z "$py" ]; then
    py=$(command -v python3 || command -v python)
fi
if [ -z "$py" ]; then
    echo "raygrpo: error: no Python found on this Ray node (see docker/ for images with everything installed)" >&2
    exit 3
fi
exec "$py" -m cluster.job_entry "$@"
