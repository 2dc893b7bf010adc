#!/usr/bin/env bash
# The patch workflow over the pinned llama.cpp.
#
#   scripts/patches.sh apply [--force]  (re)make vendor/llama.cpp-patched: pristine tree + patches/*.patch
#   scripts/patches.sh export           write patches/ from the commits of vendor/llama.cpp-patched
#   scripts/patches.sh check            prove the series applies to a pristine tree and round-trips
#   scripts/patches.sh hash             print the patch-series hash (patches + src/, as the harness reports it)
#   scripts/patches.sh patches-hash     print the hash of the patches alone (what vendor/llama.cpp-patched is made from)
#   scripts/patches.sh compat [SDIST]   bring vendor/llama.cpp to the pin + the compat series (patches/compat/);
#                                       SDIST (the pinned source package) restores the files an older series changed
#
# The compat series (patches/compat/*.patch) is build compatibility only (e.g. older system headers): it is
# applied to the stock tree vendor/llama.cpp in place (stamp: vendor/llama.cpp/.moe-subst-compat), so the stock
# and the patched tree both have it and stock with the cache off stays comparable. Its patches are written by
# hand (git format-patch form, with Upstream:/Drop-when: trailers) and applied with git apply.
#
# vendor/llama.cpp-patched is a git repository: one commit with the stock tree (the pin + the compat series),
# tagged moe-subst-base, then one commit per patch. Work there, commit, then export; never edit patches/ by hand.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pristine="$root/vendor/llama.cpp"
patched="$root/vendor/llama.cpp-patched"
stamp="$patched/.git/moe-subst-applied"
base_tag=moe-subst-base

# A fixed identity and date for the commits we make, so that nothing depends on the user's git config.
export GIT_AUTHOR_NAME=moe-subst GIT_AUTHOR_EMAIL=moe-subst@localhost
export GIT_COMMITTER_NAME=moe-subst GIT_COMMITTER_EMAIL=moe-subst@localhost
export GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' GIT_COMMITTER_DATE='2000-01-01T00:00:00Z'

die() { echo "patches: error: $*" >&2; exit 1; }
say() { echo "patches: $*"; }

series() { find "$root/patches" -maxdepth 1 -name '*.patch' | LC_ALL=C sort; }
compat_series() { [ -d "$root/patches/compat" ] && find "$root/patches/compat" -maxdepth 1 -name '*.patch' | LC_ALL=C sort; true; }

compat_hash() {  # the compat series: what vendor/llama.cpp has on top of the pin (its stamp)
    local files
    files=$(compat_series)
    if [ -z "$files" ]; then echo "none"; return; fi
    # shellcheck disable=SC2086
    cat $files | sha256sum | cut -c1-16
}

compat_files() {  # the upstream files the compat series changes, one a line
    local files
    files=$(compat_series)
    [ -n "$files" ] || return 0
    # shellcheck disable=SC2086
    sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' $files | LC_ALL=C sort -u
}

patches_hash() {  # the compat series and the patches: what vendor/llama.cpp-patched was made from (its stamp)
    local files
    files="$(compat_series) $(series)"
    if [ -z "${files// /}" ]; then echo "none"; return; fi
    # shellcheck disable=SC2086
    cat $files | sha256sum | cut -c1-16
}

series_hash() {  # the compat series, the patches and our C++ (src/): the patched build's code (provenance)
    local files
    files="$(compat_series) $(series)"
    if [ -z "${files// /}" ]; then echo "none"; return; fi
    # shellcheck disable=SC2046,SC2086
    cat $files $(find "$root/src" -type f | LC_ALL=C sort) | sha256sum | cut -c1-16
}

need_pristine() {
    [ -f "$pristine/CMakeLists.txt" ] || die "no pristine tree at vendor/llama.cpp: run ./build.sh first"
    [ "$(sed -n 1p "$pristine/.moe-subst-compat" 2>/dev/null || echo none)" = "$(compat_hash)" ] \
        || die "vendor/llama.cpp does not have the current compat series (patches/compat/): run ./build.sh"
}

# vendor/llama.cpp = the pin + the compat series, in place: the files an earlier compat series changed are restored
# from the pinned source package first (only those; the others keep their mtimes, so builds redo little)
cmd_compat() {
    local sdist=${1:-} want old_files f tmp p
    [ -f "$pristine/CMakeLists.txt" ] || die "no pristine tree at vendor/llama.cpp: run ./build.sh first"
    want=$(compat_hash)
    [ "$(sed -n 1p "$pristine/.moe-subst-compat" 2>/dev/null || echo none)" = "$want" ] && return 0
    old_files=$(sed -n '2,$p' "$pristine/.moe-subst-compat" 2>/dev/null || true)
    if [ -n "$old_files" ]; then
        [ -n "$sdist" ] && [ -f "$sdist" ] || die "vendor/llama.cpp has another compat series: the pinned source package is needed to restore $(echo $old_files)"
        tmp=$(mktemp -d)
        local top listing
        # the whole listing, then its first entry: `tar | head -n 1` under pipefail ends with tar's SIGPIPE (141) as
        # soon as the package lists more than a pipe's buffer, so the restore failed on the real source package
        listing=$(tar -tzf "$sdist") || { rm -rf "$tmp"; die "could not list $sdist"; }
        top=${listing%%$'\n'*}
        top=${top%%/*}
        # shellcheck disable=SC2046
        tar -xzf "$sdist" -C "$tmp" $(for f in $old_files; do echo "$top/vendor/llama.cpp/$f"; done) \
            || { rm -rf "$tmp"; die "could not restore $(echo $old_files) from $sdist"; }
        for f in $old_files; do cp "$tmp/$top/vendor/llama.cpp/$f" "$pristine/$f"; done
        rm -rf "$tmp"
    fi
    rm -f "$pristine/.moe-subst-compat"
    for p in $(compat_series); do
        # GIT_CEILING_DIRECTORIES: vendor/llama.cpp is no repository, and git must not find the checkout around it
        (cd "$pristine" && GIT_CEILING_DIRECTORIES="$(dirname "$pristine")" git apply --whitespace=nowarn "$p") \
            || die "compat patch $(basename "$p") does not apply to vendor/llama.cpp (the pin: $(cat "$pristine/.moe-subst-pin" 2>/dev/null))"
    done
    { echo "$want"; compat_files; } >"$pristine/.moe-subst-compat"
    [ "$want" = none ] || say "applied $(compat_series | wc -l) compat patch(es) to vendor/llama.cpp"
}

# git am with a clear error naming the failing patch; leaves no half-applied state behind.
am_series() {
    local repo=$1 p
    for p in $(series); do
        if ! git -C "$repo" am --quiet --keep-cr "$p" >/dev/null 2>"$repo/.git/am-error"; then
            git -C "$repo" am --abort >/dev/null 2>&1 || true
            echo "patches: error: patch $(basename "$p") does not apply to the pinned tree:" >&2
            sed 's/^/    /' "$repo/.git/am-error" >&2
            echo "patches: fix it in vendor/llama.cpp-patched (rebase there) and run scripts/patches.sh export" >&2
            return 1
        fi
    done
}

# the base commit (at moe-subst-base) is the stock tree: when the compat series changed, the files it changes now or
# changed before are taken from vendor/llama.cpp and the base commit is amended (the other files are untouched)
rebase_compat() {
    local have f files
    have=$(sed -n 1p "$patched/.git/moe-subst-compat" 2>/dev/null || echo none)
    [ "$have" = "$(compat_hash)" ] && return 0
    files=$( { sed -n '2,$p' "$patched/.git/moe-subst-compat" 2>/dev/null || true; sed -n '2,$p' "$pristine/.moe-subst-compat"; } | LC_ALL=C sort -u)
    for f in $files; do
        cp -p "$pristine/$f" "$patched/$f"
        git -C "$patched" add --force "$f"
    done
    git -C "$patched" commit --quiet --no-verify --allow-empty --amend --no-edit
    git -C "$patched" tag -f "$base_tag" >/dev/null
    cp "$pristine/.moe-subst-compat" "$patched/.git/moe-subst-compat"
    say "the base of vendor/llama.cpp-patched follows the compat series ($(compat_hash))"
}

cmd_apply() {
    local force=0
    [ "${1:-}" = "--force" ] && force=1
    need_pristine
    local want
    want="$(cat "$pristine/.moe-subst-pin" 2>/dev/null || echo unknown) $(patches_hash)"
    if [ -d "$patched/.git" ]; then
        if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$want" ] \
            && [ "$(git -C "$patched" rev-parse HEAD)" = "$(sed -n 2p "$stamp")" ] \
            && [ -z "$(git -C "$patched" status --porcelain --untracked-files=no)" ]; then
            say "vendor/llama.cpp-patched is up to date ($(series | wc -l) patches)"
            return 0
        fi
        # Refuse to throw away work that was not exported.
        if [ $force = 0 ] && { [ ! -f "$stamp" ] \
            || [ "$(git -C "$patched" rev-parse HEAD)" != "$(sed -n 2p "$stamp")" ] \
            || [ -n "$(git -C "$patched" status --porcelain --untracked-files=no)" ]; }; then
            die "vendor/llama.cpp-patched has commits or changes that are not in patches/: run scripts/patches.sh export (or pass --force to discard them)"
        fi
        if git -C "$patched" rev-parse -q --verify "refs/tags/$base_tag" >/dev/null \
            && [ "$(cat "$patched/.git/moe-subst-pin" 2>/dev/null)" = "$(cat "$pristine/.moe-subst-pin")" ]; then
            # Same pin: reset to the base and re-apply, touching only the files the patches change
            # (keeps mtimes, so ninja rebuilds little).
            git -C "$patched" am --abort >/dev/null 2>&1 || true
            git -C "$patched" reset --quiet --hard "$base_tag"
            rebase_compat || exit 1
            am_series "$patched" || exit 1
            printf '%s\n%s\n' "$want" "$(git -C "$patched" rev-parse HEAD)" >"$stamp"
            say "re-applied $(series | wc -l) patches to vendor/llama.cpp-patched"
            return 0
        fi
    fi
    rm -rf "$patched"
    say "copying the pristine tree to vendor/llama.cpp-patched"
    cp -a "$pristine" "$patched"
    rm -f "$patched/.moe-subst-pin" "$patched/.moe-subst-compat"
    rm -rf "$patched"/build-*
    git -C "$patched" init --quiet
    git -C "$patched" config core.autocrlf false
    printf '/build-*/\n' >>"$patched/.git/info/exclude"
    git -C "$patched" add --all --force .
    git -C "$patched" commit --quiet --no-verify -m "pristine llama.cpp from llama-cpp-python $(cat "$pristine/.moe-subst-pin")"
    git -C "$patched" tag "$base_tag"
    cp "$pristine/.moe-subst-pin" "$patched/.git/moe-subst-pin"
    cp "$pristine/.moe-subst-compat" "$patched/.git/moe-subst-compat"
    am_series "$patched" || { rm -rf "$patched"; exit 1; }
    printf '%s\n%s\n' "$want" "$(git -C "$patched" rev-parse HEAD)" >"$stamp"
    say "applied $(series | wc -l) patches to vendor/llama.cpp-patched"
}

format_series() {
    local repo=$1 out=$2
    git -C "$repo" -c core.abbrev=12 format-patch --quiet --zero-commit --no-signature --no-numbered \
        --no-stat -o "$out" "$base_tag..HEAD" >/dev/null
}

cmd_export() {
    [ -d "$patched/.git" ] || die "no vendor/llama.cpp-patched: run scripts/patches.sh apply first"
    [ -z "$(git -C "$patched" status --porcelain --untracked-files=no)" ] \
        || die "vendor/llama.cpp-patched has uncommitted changes: commit them first"
    local tmp
    tmp=$(mktemp -d)
    format_series "$patched" "$tmp"
    for p in "$tmp"/*.patch; do
        [ -e "$p" ] || continue
        grep -q '^Upstream:' "$p" || { rm -rf "$tmp"; die "$(basename "$p"): the commit message needs an 'Upstream:' trailer"; }
        grep -q '^Drop-when:' "$p" || { rm -rf "$tmp"; die "$(basename "$p"): the commit message needs a 'Drop-when:' trailer"; }
    done
    find "$root/patches" -maxdepth 1 -name '*.patch' -delete
    cp "$tmp"/*.patch "$root/patches/" 2>/dev/null || true
    rm -rf "$tmp"
    printf '%s\n%s\n' "$(cat "$pristine/.moe-subst-pin" 2>/dev/null || echo unknown) $(patches_hash)" \
        "$(git -C "$patched" rev-parse HEAD)" >"$stamp"
    say "exported $(series | wc -l) patches to patches/ (series hash $(series_hash))"
}

cmd_check() {
    need_pristine
    local tmp repo out files p f
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    repo="$tmp/tree"
    out="$tmp/out"
    mkdir -p "$repo" "$out"
    # A sparse pristine base: only the files that the series touches (the rest cannot matter to it).
    files=$(cat $(series) /dev/null | sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' | LC_ALL=C sort -u)
    for f in $files; do
        if [ -f "$pristine/$f" ]; then
            mkdir -p "$repo/$(dirname "$f")"
            cp -p "$pristine/$f" "$repo/$f"
        fi
    done
    git -C "$repo" init --quiet
    git -C "$repo" add --all --force .
    git -C "$repo" commit --quiet --allow-empty --no-verify -m base
    git -C "$repo" tag "$base_tag"
    am_series "$repo" || die "the series does not apply to the pristine tree"
    format_series "$repo" "$out"
    for p in $(series); do
        [ -f "$out/$(basename "$p")" ] || die "round trip: $(basename "$p") was not re-exported under the same name"
        diff -u "$p" "$out/$(basename "$p")" >"$tmp/diff" \
            || { cat "$tmp/diff" >&2; die "round trip: $(basename "$p") differs after apply + export"; }
        grep -q '^Upstream:' "$p" || die "$(basename "$p") has no 'Upstream:' trailer"
        grep -q '^Drop-when:' "$p" || die "$(basename "$p") has no 'Drop-when:' trailer"
    done
    [ "$(ls "$out" | wc -l)" = "$(series | wc -l)" ] || die "round trip: the export has a different number of patches"
    for p in $(compat_series); do
        grep -q '^Upstream:' "$p" || die "compat/$(basename "$p") has no 'Upstream:' trailer"
        grep -q '^Drop-when:' "$p" || die "compat/$(basename "$p") has no 'Drop-when:' trailer"
    done
    say "ok: $(series | wc -l) patches apply to the pristine tree and round-trip (series hash $(series_hash))"
}

case "${1:-}" in
    apply)  shift; cmd_apply "$@" ;;
    export) cmd_export ;;
    check)  cmd_check ;;
    hash)   series_hash ;;
    patches-hash) patches_hash ;;
    compat) shift; cmd_compat "$@" ;;
    *) echo "usage: scripts/patches.sh apply [--force] | export | check | hash | patches-hash | compat [SDIST]" >&2; exit 2 ;;
esac
