{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvpilot.namespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs on namespaced resources, in either mode. */}}
{{- define "kvpilot.namespacedRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch, update]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# issue 41: multi-pod groups (spec.parallelism.nnodes > 1) run as StatefulSets; the operator
# watches their pods and deletes a group's pods to recreate it whole (as LWS does).
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]
# services, configmaps, networkpolicies: list and watch, by the operator's label, so that a
# child edited or deleted by hand is repaired at once (operator/child_watch.py)
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# configmaps: the engine config (operator: get/create/patch/delete) and the tuner's study
# journal (get, create, and update: its appends are PUTs guarded by resourceVersion).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
{{- if and .Values.peering (not .Values.watch.clusterWide) }}
# Kopf peering (namespaced operators): the KopfPeering objects of the peering name.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
# issue 17: the admin-token Secret (created once, never read back by the operator beyond get)
# and the NetworkPolicy per InferenceService
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
{{- end -}}
