{{/*
kubetune.fullname: the release's name, used for every object the chart creates.
Truncated to 63 characters because Service and label values cannot be longer.
*/}}
{{- define "kubetune.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
kubetune.labels: the standard labels on every object (selectors use kubetune.selectorLabels,
which must never change between releases).
*/}}
{{- define "kubetune.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{ include "kubetune.selectorLabels" . }}
{{- end -}}

{{- define "kubetune.selectorLabels" -}}
app.kubernetes.io/name: kubetune-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* kubetune.serviceAccountName: the operator's ServiceAccount. */}}
{{- define "kubetune.serviceAccountName" -}}
{{- default (include "kubetune.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* kubetune.operatorImage: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "kubetune.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/*
kubetune.scrapeAnnotations: where annotation-based Prometheus discovery finds the operator's metrics.
*/}}
{{- define "kubetune.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end -}}

{{/*
kubetune.trainerPodSelector: the trainers' rank-0 pods, the only ones serving metrics. The first
two labels are on every pod the operator renders (kubetune_operator/naming.py); the training
operator adds replica-type, and rank 0 runs in the master.
*/}}
{{- define "kubetune.trainerPodSelector" -}}
matchLabels:
  app.kubernetes.io/managed-by: kubetune
  training.kubeflow.org/replica-type: master
matchExpressions:
  - {key: kubetune.dev/trainingjob, operator: Exists}
{{- end -}}
