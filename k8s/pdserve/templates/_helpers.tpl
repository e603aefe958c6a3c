{{/* Names: <release>-pdserve, truncated so StatefulSet pods and revision labels stay under 63. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Labels of one component (router, prefill, decode, colocated, redis). ctx: {root, component} */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference; never ":latest". ctx: {root, image (overrides of .Values.image)} */}}
{{- define "pdserve.image" -}}
{{- $img := merge (deepCopy (default (dict) .image)) .root.Values.image }}
{{- $tag := default .root.Chart.AppVersion $img.tag | toString }}
{{- if eq $tag "latest" }}
{{- fail "image tag \"latest\" is not allowed: pin a version" }}
{{- end }}
{{- if $img.digest }}
{{- printf "%s:%s@%s" $img.repository $tag $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{/* The registry URL given to --registry: the in-release Redis (with $(REDIS_PASSWORD), which Kubernetes expands from the pod's env), an external URL, or $(PDSERVE_REGISTRY_URL) from a Secret. */}}
{{- define "pdserve.registryUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s-redis:%d/0" (include "pdserve.fullname" .) (int .Values.redis.port) }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s-redis:%d/0" (include "pdserve.fullname" .) (int .Values.redis.port) }}
{{- else if .Values.redis.externalUrlSecret.name }}
{{- print "$(PDSERVE_REGISTRY_URL)" }}
{{- else if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- else }}
{{- fail "redis.enabled=false needs redis.externalUrl or redis.externalUrlSecret.name" }}
{{- end }}
{{- end }}

{{- define "pdserve.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name }}
{{- end }}

{{- define "pdserve.authSecretName" -}}
{{- default (printf "%s-internal-token" (include "pdserve.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "pdserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* REDIS_PASSWORD from the in-release Redis's Secret (nothing when that Redis has no password). */}}
{{- define "pdserve.redisPasswordEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end }}
{{- end }}

{{/* Environment shared by router and workers: threads sized to the CPU limit, caches under /tmp, the internal token, the Redis password and the registry URL Secret. ctx: {root, container} */}}
{{- define "pdserve.commonEnv" -}}
{{- $root := .root -}}
- name: HOME
  value: /tmp
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: PDSERVE_NUM_THREADS
  valueFrom:
    resourceFieldRef:
      containerName: {{ .container }}
      resource: limits.cpu
      divisor: "1"
- name: OMP_NUM_THREADS
  valueFrom:
    resourceFieldRef:
      containerName: {{ .container }}
      resource: limits.cpu
      divisor: "1"
{{- if $root.Values.auth.enabled }}
- name: PDSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.authSecretName" $root }}
      key: {{ $root.Values.auth.secretKey }}
{{- end }}
{{- include "pdserve.redisPasswordEnv" $root }}
{{- if and (not $root.Values.redis.enabled) $root.Values.redis.externalUrlSecret.name }}
- name: PDSERVE_REGISTRY_URL
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.externalUrlSecret.name }}
      key: {{ $root.Values.redis.externalUrlSecret.key }}
{{- end }}
{{- end }}

{{/* gRPC health probes on a numeric port (Kubernetes gRPC probes take no named ports). ctx: {root, port} */}}
{{- define "pdserve.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc:
    port: {{ int .port }}
    service: liveness
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  grpc:
    port: {{ int .port }}
    service: readiness
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  grpc:
    port: {{ int .port }}
    service: liveness
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end }}

{{/* preStop: optionally wait (Service endpoints catch up), then SIGTERM pdserve (PID 1), which starts the drain. ctx: sleep seconds */}}
{{- define "pdserve.preStop" -}}
preStop:
  exec:
    command:
      - /bin/sh
      - -c
      {{- if gt (int .) 0 }}
      - {{ printf "sleep %d; kill -TERM 1" (int .) | quote }}
      {{- else }}
      - kill -TERM 1
      {{- end }}
{{- end }}

{{/* Volumes every pdserve pod has: the model, /tmp. */}}
{{- define "pdserve.modelVolume" -}}
{{- $m := .Values.model -}}
- name: model
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit }}
{{- else }}
{{- fail (printf "model.source must be pvc, hostPath or initContainer, got %q" (toString $m.source)) }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "pdserve.modelMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The init container that fills the model emptyDir (model.source=initContainer). */}}
{{- define "pdserve.modelInit" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "initContainer" -}}
{{- $img := $m.initContainer.image }}
{{- $ref := include "pdserve.image" (dict "root" . "image" (dict)) }}
{{- if $img.repository }}
{{- $ref = include "pdserve.image" (dict "root" . "image" (dict "repository" $img.repository "tag" (required "model.initContainer.image.tag is required" $img.tag) "digest" "")) }}
{{- end -}}
initContainers:
  - name: fetch-model
    image: {{ $ref }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      {{- toYaml $m.initContainer.command | nindent 6 }}
    env:
      - name: HOME
        value: /tmp
    resources:
      {{- toYaml $m.initContainer.resources | nindent 6 }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ $m.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* nodeSelector / tolerations / affinity of one component's values. */}}
{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
