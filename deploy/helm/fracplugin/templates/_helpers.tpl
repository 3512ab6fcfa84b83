{{/*
Names. The release "fracplugin" (what daemonset/ is rendered with) gives
"fracplugin" for every object, as the kustomize manifests always had.
*/}}
{{- define "fracplugin.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fracplugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fracplugin.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "fracplugin.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/part-of: fracplugin
{{- if .Values.helmLabels }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
{{- end -}}

{{/*
Selector labels of a DaemonSet (immutable once created): name + component.
Component "node-daemon" is the single DaemonSet and the doors of the split
layout (so switching layout keeps the rolling DaemonSet), "mps" the MPS role.
Call with (dict "root" $ "component" "node-daemon").
*/}}
{{- define "fracplugin.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .root.Values.helmLabels }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}
{{- end -}}

{{- define "fracplugin.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* "true" when the device plugin door runs (default scheduler and enabled). */}}
{{- define "fracplugin.devicePluginOn" -}}
{{- if and .Values.devicePlugin.enabled (eq .Values.scheduler "default") -}}true{{- end -}}
{{- end -}}

{{- define "fracplugin.devicePluginDir" -}}
{{- printf "%s/device-plugins" (trimSuffix "/" .Values.hostPaths.kubeletRoot) -}}
{{- end -}}
{{- define "fracplugin.podResourcesDir" -}}
{{- printf "%s/pod-resources" (trimSuffix "/" .Values.hostPaths.kubeletRoot) -}}
{{- end -}}

{{/*
Rules between values that values.schema.json cannot express; each failure
names the keys, the values and the rule.
*/}}
{{- define "fracplugin.validate" -}}
{{- $run := trimSuffix "/" .Values.hostPaths.run -}}
{{- range $key := list "stateDir" "mpsRoot" -}}
{{- $p := index $.Values.hostPaths $key -}}
{{- if not (hasPrefix (printf "%s/" $run) $p) -}}
{{- fail (printf "hostPaths.%s=%q must lie under hostPaths.run=%q (one hostPath volume holds the state and the MPS root)" $key $p $run) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.layout "split") (not (hasPrefix (printf "%s/" $run) .Values.mps.apiSocket)) -}}
{{- fail (printf "mps.apiSocket=%q must lie under hostPaths.run=%q (both roles mount that directory)" .Values.mps.apiSocket $run) -}}
{{- end -}}
{{- if and (eq .Values.layout "split") (not .Values.mps.enabled) -}}
{{- fail "layout=split runs a DaemonSet for MPS: it needs mps.enabled=true (use layout=single with mps.enabled=false)" -}}
{{- end -}}
{{- if and (not .Values.nri.enabled) (not (include "fracplugin.devicePluginOn" .)) -}}
{{- fail (printf "nri.enabled=false with scheduler=%q and devicePlugin.enabled=%v leaves no door: nothing would enforce fractions" .Values.scheduler .Values.devicePlugin.enabled) -}}
{{- end -}}
{{- end -}}

{{/*
Pod affinity: the user's affinity with the GPU Operator rules (values
gpuOperator.driverUpgrade) ANDed into each of its required node selector
terms. Node selector terms are ORed and the expressions of one term ANDed, so
"(client label absent or true) and (upgrade state absent or upgrade-done)" is
four terms per user term. A DaemonSet controller removes a running pod from a
node that stops matching, which is what makes the label flips evict us.
Facts: gpu-fractioning-reference.md section 1 (deploy.client nodeSelector and
the driver-upgrade-state affinity of the reference's daemons).
*/}}
{{- define "fracplugin.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) -}}
{{- if .Values.gpuOperator.driverUpgrade -}}
{{- $client := list
  (dict "key" "nvidia.com/gpu.deploy.client" "operator" "DoesNotExist")
  (dict "key" "nvidia.com/gpu.deploy.client" "operator" "In" "values" (list "true")) -}}
{{- $state := list
  (dict "key" "nvidia.com/gpu-driver-upgrade-state" "operator" "DoesNotExist")
  (dict "key" "nvidia.com/gpu-driver-upgrade-state" "operator" "In" "values" (list "upgrade-done")) -}}
{{- $nodeAffinity := get $affinity "nodeAffinity" | default dict -}}
{{- $required := get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $userTerms := get $required "nodeSelectorTerms" | default (list dict) -}}
{{- $terms := list -}}
{{- range $t := $userTerms -}}
{{- range $c := $client -}}
{{- range $s := $state -}}
{{- $term := deepCopy $t -}}
{{- $_ := set $term "matchExpressions" (concat (get $t "matchExpressions" | default list) (list $c $s)) -}}
{{- $terms = append $terms $term -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity -}}
{{- end -}}
{{- if $affinity -}}
{{- toYaml $affinity -}}
{{- end -}}
{{- end -}}
