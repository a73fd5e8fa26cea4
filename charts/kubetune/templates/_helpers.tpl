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

{{/* kubetune.operatorImage: repository:tag, the tag defaulting to the chart's appVersion; a tag
that is a digest (sha256:...) gives repository@sha256:... */}}
{{- define "kubetune.operatorImage" -}}
{{- $tag := default .Chart.AppVersion .Values.operator.image.tag -}}
{{- printf "%s%s%s" .Values.operator.image.repository (ternary "@" ":" (hasPrefix "sha256:" $tag)) $tag -}}
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
kubetune.pytorchjobEnabled / kubetune.trainjobEnabled: "true" when TrainingJobs may use that
backend (the default `backend`, or one enabled beside it); empty otherwise, so `if` reads them.
kubetune.backends: the enabled backends, comma-separated, for the operator.
*/}}
{{- define "kubetune.pytorchjobEnabled" -}}
{{- if or (eq .Values.backend "pytorchjob") .Values.pytorchjob.enabled }}true{{ end -}}
{{- end -}}

{{- define "kubetune.trainjobEnabled" -}}
{{- if or (eq .Values.backend "trainjob") .Values.trainjob.enabled }}true{{ end -}}
{{- end -}}

{{- define "kubetune.backends" -}}
{{- $enabled := list -}}
{{- if include "kubetune.pytorchjobEnabled" . }}{{ $enabled = append $enabled "pytorchjob" }}{{ end -}}
{{- if include "kubetune.trainjobEnabled" . }}{{ $enabled = append $enabled "trainjob" }}{{ end -}}
{{- join "," $enabled -}}
{{- end -}}

{{/*
kubetune.pytorchjobRank0Selector / kubetune.trainjobRank0Selector: the trainers' rank-0 pods, the
only ones serving metrics, as each backend labels them (kubetune_operator/backends, rank0_pod_selector).
The first two labels are on every pod the operator renders (kubetune_operator/naming.py). PyTorchJob:
the training operator labels the Master (rank 0) replica-type=master. TrainJob: rank 0 runs in the
pod of completion index 0 of the JobSet's node Job, as the Job controller labels it.
*/}}
{{- define "kubetune.pytorchjobRank0Selector" -}}
matchLabels:
  app.kubernetes.io/managed-by: kubetune
  training.kubeflow.org/replica-type: master
matchExpressions:
  - {key: kubetune.dev/trainingjob, operator: Exists}
{{- end -}}

{{- define "kubetune.trainjobRank0Selector" -}}
matchLabels:
  app.kubernetes.io/managed-by: kubetune
  jobset.sigs.k8s.io/replicatedjob-name: node
  batch.kubernetes.io/job-completion-index: "0"
matchExpressions:
  - {key: kubetune.dev/trainingjob, operator: Exists}
{{- end -}}

{{/*
The admission webhook's objects: its Service, the ValidatingWebhookConfiguration the chart owns
(the operator may patch only this one, and only its caBundle), cert-manager's Certificate and the
Secret it writes, and the DNS names the serving certificate must carry (the API server calls
https://<service>.<namespace>.svc).
*/}}
{{- define "kubetune.webhookService" -}}
{{- printf "%s-webhook" (include "kubetune.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetune.webhookConfiguration" -}}
{{- printf "%s-trainingjobs" (include "kubetune.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetune.webhookCertificate" -}}
{{- printf "%s-webhook-tls" (include "kubetune.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetune.webhookDnsNames" -}}
{{- $service := include "kubetune.webhookService" . -}}
{{- $ns := .Release.Namespace -}}
{{- list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns) (printf "%s.%s.svc.cluster.local" $service $ns) | join "," -}}
{{- end -}}

{{- define "kubetune.webhookFromCertManager" -}}
{{- if and .Values.webhook.enabled (eq .Values.webhook.certificates "cert-manager") }}true{{ end -}}
{{- end -}}
