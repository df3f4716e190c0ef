{{/*
`loraplex engine serve`'s speculative decoding flags from engine.speculative, as YAML list items (none when method
is ""). What the engine would refuse at start (engine/spec_decode/config.py) fails the render here instead, the
message naming the value:

    method        ngram | draft | eagle | eagle3     ("replay" is the benchmarks' own)
    k             numSpeculativeTokens in 1..16
    draft         needs draftModel;  draftAdapters, discoverDraftAdapters: draft only
    eagle/eagle3  need draftHead;    adapterDraftHeads: eagle only
    paths         draftModel, draftHead absolute (inside the pods)
    ngram         ngramMin <= ngramMax (null: the engine's 1 / 4)
    any method    no --tensor-parallel-size above 1 in engine.extraArgs
*/}}
{{- define "loraplex.engine.speculativeArgs" -}}
{{- $s := .Values.engine.speculative }}
{{- $m := $s.method | default "" }}
{{- if $m }}
{{- if eq $m "replay" }}
{{- fail "engine.speculative.method \"replay\" is for benchmarks only (it replays a recorded run's tokens); choose ngram, draft, eagle or eagle3" }}
{{- end }}
{{- if not (has $m (list "ngram" "draft" "eagle" "eagle3")) }}
{{- fail (printf "engine.speculative.method %q is not supported; choose \"\" (off), ngram, draft, eagle or eagle3" $m) }}
{{- end }}
{{- $k := $s.numSpeculativeTokens }}
{{- if or (kindIs "invalid" $k) (lt (int64 $k) 1) (gt (int64 $k) 16) }}
{{- fail (printf "engine.speculative.numSpeculativeTokens must be in 1..16, got %v" $k) }}
{{- end }}
{{- range $key := list "draftModel" "draftHead" }}
{{- $path := get $s $key | default "" }}
{{- if and $path (not (hasPrefix "/" $path)) }}
{{- fail (printf "engine.speculative.%s %q must be an absolute path inside the pods (e.g. under model.mountPath)" $key $path) }}
{{- end }}
{{- end }}
{{- if and (eq $m "draft") (not $s.draftModel) }}
{{- fail "engine.speculative.method draft needs engine.speculative.draftModel: the folder of a small causal LM sharing the target's tokenizer" }}
{{- end }}
{{- if and (ne $m "draft") $s.draftModel }}
{{- fail (printf "engine.speculative.draftModel is set but method is %q; it is read by method draft only" $m) }}
{{- end }}
{{- if and (has $m (list "eagle" "eagle3")) (not $s.draftHead) }}
{{- $what := eq $m "eagle" | ternary "a draft head trained on this target's hidden states" "a published EAGLE-3 draft of this target" }}
{{- fail (printf "engine.speculative.method %s needs engine.speculative.draftHead: the folder of %s" $m $what) }}
{{- end }}
{{- if and (not (has $m (list "eagle" "eagle3"))) $s.draftHead }}
{{- fail (printf "engine.speculative.draftHead is set but method is %q; it is read by methods eagle and eagle3 only" $m) }}
{{- end }}
{{- if and (ne $m "draft") (or $s.draftAdapters $s.discoverDraftAdapters) }}
{{- fail (printf "engine.speculative.draftAdapters / discoverDraftAdapters are set but method is %q; per-adapter drafts are LoRAs of a draft model: method draft" $m) }}
{{- end }}
{{- if and (ne $m "eagle") $s.adapterDraftHeads }}
{{- fail (printf "engine.speculative.adapterDraftHeads is set but method is %q; per-adapter heads are read by method eagle only" $m) }}
{{- end }}
{{- range $i, $arg := $.Values.engine.extraArgs }}
{{- $tp := "" }}
{{- if hasPrefix "--tensor-parallel-size=" $arg }}{{ $tp = trimPrefix "--tensor-parallel-size=" $arg }}{{ end }}
{{- if and (eq $arg "--tensor-parallel-size") (lt (add1 $i) (len $.Values.engine.extraArgs)) }}{{ $tp = index $.Values.engine.extraArgs (add1 $i) }}{{ end }}
{{- if and $tp (ne $tp "1") }}
{{- fail (printf "engine.speculative.method %s needs tensor parallel size 1, but engine.extraArgs sets --tensor-parallel-size %s" $m $tp) }}
{{- end }}
{{- end }}
{{- $ngramMin := kindIs "invalid" $s.ngramMin | ternary 1 $s.ngramMin | int64 }}
{{- $ngramMax := kindIs "invalid" $s.ngramMax | ternary 4 $s.ngramMax | int64 }}
{{- if gt $ngramMin $ngramMax }}
{{- fail (printf "engine.speculative.ngramMin (%d) must be <= engine.speculative.ngramMax (%d); null is the engine's 1 and 4" $ngramMin $ngramMax) }}
{{- end }}
- --speculative-method
- {{ $m | quote }}
- --num-speculative-tokens
- {{ int64 $k | toString | quote }}
{{- with $s.draftModel }}
- --speculative-draft-model
- {{ . | quote }}
{{- end }}
{{- with $s.draftHead }}
- --speculative-draft-head
- {{ . | quote }}
{{- end }}
{{- if $s.verifyCudaGraphs }}
- --speculative-verify-cuda-graphs
{{- end }}
{{- if not (kindIs "invalid" $s.draftNumKvBlocks) }}
- --speculative-draft-num-kv-blocks
- {{ int64 $s.draftNumKvBlocks | toString | quote }}
{{- end }}
{{- range $id, $dir := $s.draftAdapters }}
- --speculative-draft-adapter
- {{ printf "%s=%s" $id $dir | quote }}
{{- end }}
{{- if $s.discoverDraftAdapters }}
- --speculative-discover-draft-adapters
{{- end }}
{{- if not (kindIs "invalid" $s.draftMaxLoraRank) }}
- --speculative-draft-max-lora-rank
- {{ int64 $s.draftMaxLoraRank | toString | quote }}
{{- end }}
{{- range $id, $dir := $s.adapterDraftHeads }}
- --speculative-adapter-draft-head
- {{ printf "%s=%s" $id $dir | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.ngramMin) }}
- --speculative-ngram-min
- {{ int64 $s.ngramMin | toString | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.ngramMax) }}
- --speculative-ngram-max
- {{ int64 $s.ngramMax | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
