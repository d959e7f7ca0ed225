#!/usr/bin/env bash
# Issue 53's cluster benchmark (benchmarks/cluster_scale.py) on the device machine's 16 CPU cores: how far the control
# plane goes with more cores than the 2-core development machine. No GPU is used. The image has neither PostgreSQL
# nor Redis nor the service's Python packages, so they travel:
#   here:    the service's cp312 wheels: ortools in .whlsvc (30 MB), the rest in .whl (20 MB); .pgbin holds the
#            pgserver wheel (PostgreSQL 16 binaries, run from its folder) and this machine's redis-server with the
#            three libraries the image may lack (liblzf, libjemalloc, libatomic)
#   device:  bash benchmarks/gpu_cluster_scale.sh store        # carry [".whlsvc", ".pgbin"]
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_cluster_scale.sh run "<run 1's args>" "<run 2's>"  # carry [".whl"]
#   device:  bash benchmarks/gpu_cluster_scale.sh wait 540    # again until it says "all done"
# (.whlsvc .whl .pgbin are listed in .git/info/exclude.) Results come back in $OUT/results.tar.gz.
set -uo pipefail
stage="${1:-run}"; shift || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-/tmp/out}"
LP=/tmp/lp  # readable by the PostgreSQL user (/root is not)
case $stage in
  store)
    mkdir -p $LP/svcsite $LP/redis && \
      python3 -m pip install -q --no-index --no-deps --no-compile --target $LP/svcsite .whlsvc/*.whl && \
      (cd $LP && python3 -m zipfile -e "$OLDPWD"/.pgbin/pgserver-*.whl pgwheel) && \
      cp .pgbin/redis-server $LP/redis/ && cp -r .pgbin/lib $LP/redis/ && chmod +x $LP/redis/redis-server \
      $LP/pgwheel/pgserver/pginstall/bin/* && ls $LP $LP/pgwheel/pgserver/pginstall/bin | tr '\n' ' ' ;;
  servers)
    # PostgreSQL refuses to run as root: its own user. Redis keeps nothing on disk, as on the dev machine.
    id lp >/dev/null 2>&1 || useradd -m lp
    pg=$LP/pgwheel/pgserver/pginstall
    if [ ! -d $LP/pg/data ]; then
      mkdir -p $LP/pg && chown lp $LP/pg && chmod -R a+rX $LP/pgwheel && chmod a+rx $LP
      su lp -s /bin/bash -c "LD_LIBRARY_PATH=$pg/lib $pg/bin/initdb -D $LP/pg/data -U postgres --auth=trust -E UTF8 \
        >$LP/pg/initdb.log 2>&1" || { cat $LP/pg/initdb.log; exit 3; }
    fi
    su lp -s /bin/bash -c "LD_LIBRARY_PATH=$pg/lib $pg/bin/pg_ctl -D $LP/pg/data -l $LP/pg/server.log -w -o \
      '-c listen_addresses=127.0.0.1 -c port=5432 -c max_connections=400 -c shared_buffers=4GB -c huge_pages=off \
       -c dynamic_shared_memory_type=mmap -c unix_socket_directories=/tmp' start" || { tail -20 $LP/pg/server.log; exit 3; }
    LD_LIBRARY_PATH=$LP/redis/lib $LP/redis/redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no \
      --daemonize yes --logfile $LP/redis.log || { cat $LP/redis.log; exit 3; } ;;
  run)
    test -d $LP/svcsite || { echo "the service's wheels are gone: run store again"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target $LP/svcsite .whl/*.whl || exit 3
    bash "$0" servers || exit 3
    rm -rf $LP/repo && cp -r . $LP/repo && mkdir -p $LP/results
    # Each argument is one run's arguments; the runs go one after another, in the background.
    printf '%s\n' "$@" > $LP/runs.txt
    (cd $LP/repo && PYTHONPATH=$LP/svcsite:. setsid nohup timeout 3000 bash -c 'i=0; while read -r args; do \
      i=$((i+1)); python3 -m benchmarks.cluster_scale $args > '$LP'/cluster_scale-$i.log 2>&1 < /dev/null; \
      cp benchmarks/results/cluster_scale-*-gpu-*.json '$LP'/results/run$i.json; done < '$LP'/runs.txt' \
      < /dev/null > /dev/null 2>&1 &)
    sleep 20; exec bash "$0" wait 500 ;;
  wait)
    deadline=$(( $(date +%s) + ${1:-540} ))
    while pgrep -f "benchmarks.cluster_scale" >/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 10; done
    for log in $LP/cluster_scale-*.log; do echo "== $log"; grep -vE "^\{" "$log" | tail -8; done
    pgrep -f "benchmarks.cluster_scale" >/dev/null && echo "still running" || echo "all done"
    (cd $LP && tar czf "$OUT"/results.tar.gz results cluster_scale-*.log) && tar tzf "$OUT"/results.tar.gz ;;
esac
