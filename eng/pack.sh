#!/usr/bin/env bash
# Packs the three library packages (README, licence expression, XML docs, symbols, SourceLink) into artifacts/.
# SourceLink maps the sources to the repository's GitHub remote: run this from a clone that has one (in a clone without
# a remote, SourceLink warns that it has no source control information, and the packages carry no source link).
set -euo pipefail
cd "$(dirname "$0")/.."
for project in src/*/*.csproj; do
  dotnet pack "$project" -c Release -p:ExactlyOnceSourceLink=true -o artifacts -nologo
done
