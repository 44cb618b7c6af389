#!/usr/bin/env bash
# The morning's rows (../data-path-11-24/run.sh) again, on a later build; JSON here.
exec "$(dirname "$0")/../data-path-11-24/run.sh" docs/bench/data-path-11-24-evening
