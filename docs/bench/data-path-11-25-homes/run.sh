#!/usr/bin/env bash
# Issue 18's rows and the isolation mix again, on the build whose streams keep to home
# channels (the commands of ../data-path-11-25-credit/run.sh); JSON here.
exec "$(dirname "$0")/../data-path-11-25-credit/run.sh" docs/bench/data-path-11-25-homes
