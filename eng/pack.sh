#!/usr/bin/env bash
# Packs the three library packages (with README, licence, symbols and SourceLink) into artifacts/.
# SourceLink needs the repository's GitHub remote: run this from a clone that has one.
set -euo pipefail
cd "$(dirname "$0")/.."
dotnet pack ExactlyOnce.slnx -c Release -p:SourceLink=true -o artifacts -nologo
