# A/B helpers for a lent-GPU call: the same command on this tree and on earlier trees, interleaved in one call.
# Source after scripts/gpu_env.sh (it defines `step`, $OUT and $M):
#   source scripts/gpu_env.sh && source scripts/ab_trees.sh
#   before=$(overlay .before)        # .before/pdserve: `git archive REV pdserve | tar -x -C .before`, carried
#   AB_MODEL=$(model llama-3.1-8b) AB_FLAGS="--batch-sizes 1 --input-lens 1024 --output-lens 64"
#   one_batch bs1_after 120 --quantization fp8
#   in_tree "$before" one_batch bs1_before 120 --quantization fp8
# `model` comes from scripts/gpu_session.sh (source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)).

# overlay DIR: a temporary copy of this tree's router/ with DIR/pdserve beside it; prints its folder
overlay() {
  local tree
  tree=$(mktemp -d) && cp -r router "$tree"/ && cp -r "$1"/pdserve "$tree"/ && echo "$tree"
}

# in_tree TREE CMD...: CMD run in TREE with TREE's pdserve and router first on PYTHONPATH (the carried wheels stay)
in_tree() {
  local tree=$1 site
  shift
  site=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
  (cd "$tree" && PYTHONPATH="$tree:$tree/router:$site" "$@")
}

# one_batch NAME LIMIT FLAGS...: a step running pdserve.bench.one_batch on $AB_MODEL with $AB_FLAGS, then FLAGS,
# its JSON and log under $OUT/NAME
one_batch() {
  local name=$1 limit=$2
  shift 2
  # shellcheck disable=SC2086  # AB_FLAGS is a list of flags
  TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch --model-path "$AB_MODEL" $AB_FLAGS "$@" \
    --out "$OUT/$name"
}
