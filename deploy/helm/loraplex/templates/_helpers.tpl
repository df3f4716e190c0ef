{{/* Names, labels and the pieces every workload shares. */}}

{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; component names append "-platform", "-engine", ... (so kept to 40 chars). */}}
{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; call with (dict "ctx" $ "component" "platform"). */}}
{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" .ctx }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The ServiceAccount every pod runs as. */}}
{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "loraplex.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end }}

{{/* Pod labels beyond the selector labels (workload identity). */}}
{{- define "loraplex.podIdentityLabels" -}}
{{- if .Values.serviceAccount.azureWorkloadIdentity }}
azure.workload.identity/use: "true"
{{- end }}
{{- end }}

{{/* How many engine URLs the platform gets: every replica the StatefulSet can have. */}}
{{- define "loraplex.engine.maxReplicas" -}}
{{- if .Values.engine.autoscaling.enabled }}{{ .Values.engine.autoscaling.maxReplicas }}{{ else }}{{ .Values.engine.replicas }}{{ end }}
{{- end }}

{{- define "loraplex.platform.fullname" -}}{{ include "loraplex.fullname" . }}-platform{{- end }}
{{- define "loraplex.engine.fullname" -}}{{ include "loraplex.fullname" . }}-engine{{- end }}
{{- define "loraplex.dev.fullname" -}}{{ include "loraplex.fullname" . }}-dev{{- end }}

{{/* image: call with (dict "image" .Values.platform.image "ctx" $). An empty tag means the chart's appVersion. */}}
{{- define "loraplex.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end }}

{{/*
Secret names. With devServices.enabled every credential comes from the chart's generated dev Secret;
otherwise from the existingSecret each section names (created by the operator, see docs/deploy.md).
*/}}
{{- define "loraplex.secret.database" -}}
{{- if .Values.devServices.enabled }}{{ include "loraplex.dev.fullname" . }}{{ else }}{{ required "database.existingSecret is required (a Secret with key database-url)" .Values.database.existingSecret }}{{ end }}
{{- end }}
{{- define "loraplex.secret.redis" -}}
{{- if .Values.devServices.enabled }}{{ include "loraplex.dev.fullname" . }}{{ else }}{{ required "redis.existingSecret is required when redis.enabled (a Secret with key redis-url)" .Values.redis.existingSecret }}{{ end }}
{{- end }}
{{- define "loraplex.secret.s3" -}}
{{- if .Values.devServices.enabled }}{{ include "loraplex.dev.fullname" . }}{{ else }}{{ .Values.s3.existingSecret }}{{ end }}
{{- end }}
{{- define "loraplex.secret.auth" -}}
{{- if .Values.devServices.enabled }}{{ include "loraplex.dev.fullname" . }}{{ else }}{{ required "auth.existingSecret is required (a Secret with keys admin-key and secret-key)" .Values.auth.existingSecret }}{{ end }}
{{- end }}

{{- define "loraplex.s3.endpointUrl" -}}
{{- if .Values.devServices.enabled }}{{ printf "http://%s-minio:9000" (include "loraplex.dev.fullname" .) }}{{ else }}{{ .Values.s3.endpointUrl }}{{ end }}
{{- end }}

{{/* A secretKeyRef env var: (dict "name" "LORAPLEX_X" "secret" "s" "key" "k"). */}}
{{- define "loraplex.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
{{- end }}

{{/* The blob store settings (platform, engines, migration job). */}}
{{- define "loraplex.env.s3" -}}
- name: LORAPLEX_BLOB_BACKEND
  value: s3
- name: LORAPLEX_S3_BUCKET
  value: {{ .Values.s3.bucket | quote }}
- name: LORAPLEX_S3_REGION
  value: {{ .Values.s3.region | quote }}
{{- with (include "loraplex.s3.endpointUrl" .) }}
- name: LORAPLEX_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with (include "loraplex.secret.s3" .) }}
{{ include "loraplex.secretEnv" (dict "name" "LORAPLEX_S3_ACCESS_KEY_ID" "secret" . "key" "access-key-id") }}
{{ include "loraplex.secretEnv" (dict "name" "LORAPLEX_S3_SECRET_ACCESS_KEY" "secret" . "key" "secret-access-key") }}
{{- end }}
{{- end }}

{{/* Settings the platform and the migration job share. */}}
{{- define "loraplex.env.platformCommon" -}}
- name: LORAPLEX_ENVIRONMENT
  value: {{ .Values.platform.environment | quote }}
- name: LORAPLEX_DATA_DIR
  value: /tmp/loraplex
{{ include "loraplex.secretEnv" (dict "name" "LORAPLEX_DATABASE_URL" "secret" (include "loraplex.secret.database" .) "key" "database-url") }}
{{ include "loraplex.secretEnv" (dict "name" "LORAPLEX_ADMIN_KEY" "secret" (include "loraplex.secret.auth" .) "key" "admin-key") }}
{{ include "loraplex.secretEnv" (dict "name" "LORAPLEX_SECRET_KEY" "secret" (include "loraplex.secret.auth" .) "key" "secret-key") }}
{{ include "loraplex.env.s3" . }}
{{- end }}

{{/* http://<release>-engine-<i>.<release>-engine.<ns>.svc.<domain>:<port> for every engine replica the StatefulSet
can have (engine.replicas, or engine.autoscaling.maxReplicas), as JSON. */}}
{{- define "loraplex.engineUrls" -}}
{{- $urls := list }}
{{- $name := include "loraplex.engine.fullname" . }}
{{- range $i := until (int (include "loraplex.engine.maxReplicas" .)) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.engine.port)) }}
{{- end }}
{{- toJson $urls }}
{{- end }}

{{/* The model volume and mount (engine and platform). */}}
{{- define "loraplex.model.volume" -}}
- name: model
{{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- define "loraplex.model.mount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* Tuning configs: ConfigMap keys are "<device>__<op>.json" (keys cannot hold "/"); items put them back in folders. */}}
{{- define "loraplex.tuning.key" -}}
{{- $parts := splitList "/" . }}{{ printf "%s__%s" (index $parts 2) (index $parts 3) }}
{{- end }}
{{- define "loraplex.tuning.path" -}}
{{- $parts := splitList "/" . }}{{ printf "%s/%s" (index $parts 2) (index $parts 3) }}
{{- end }}

{{/* HPA behavior of the engines: slow to remove a GPU replica (minutes to load), bounded growth. */}}
{{- define "loraplex.engine.scalingBehavior" -}}
{{- $a := .Values.engine.autoscaling -}}
scaleUp:
  stabilizationWindowSeconds: 0
  policies:
    - type: Pods
      value: {{ $a.scaleUpReplicasPerMinute }}
      periodSeconds: 60
scaleDown:
  stabilizationWindowSeconds: {{ $a.scaleDownStabilizationSeconds }}
  policies:
    - type: Pods
      value: 1
      periodSeconds: 300
{{- end }}

{{/* A PodDisruptionBudget's spec body: call with (dict "pdb" .Values.x.pdb "ctx" $ "component" "x"). */}}
{{- define "loraplex.pdbSpec" -}}
{{- if not (kindIs "invalid" .pdb.minAvailable) }}
minAvailable: {{ .pdb.minAvailable }}
{{- else }}
maxUnavailable: {{ .pdb.maxUnavailable }}
{{- end }}
{{- with .pdb.unhealthyPodEvictionPolicy }}
unhealthyPodEvictionPolicy: {{ . }}
{{- end }}
selector:
  matchLabels:
    {{- include "loraplex.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
{{- end }}
